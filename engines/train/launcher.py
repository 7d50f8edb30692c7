"""Start the ranks of a run through torchrun's Python API (``elastic_launch``).

Single node, no restarts: a failing rank ends the run and its error is reported back. The
rendezvous is torchrun's ``--standalone`` one (c10d store on a free local port).
"""

from __future__ import annotations

import uuid

from polyaccel.errors import PolyaccelError

from .options import TrainOptions


class RankFailed(PolyaccelError):
    """A rank of ``polyaccel train`` exited with an error."""


def launch(opts: TrainOptions) -> dict:
    """Run ``opts.nproc`` ranks of :func:`worker.rank_main` and return rank 0's result."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .worker import rank_main

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=opts.nproc,
        run_id=f"polyaccel-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_configs={"rank": 0},
        max_restarts=0, monitor_interval=0.1, start_method="spawn",
    )
    try:
        results = elastic_launch(config, rank_main)(opts)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message = failure.message
        if isinstance(message, dict):  # the error file of a @record-ed entry point
            message = message.get("message", message)
        raise RankFailed(f"rank {rank} failed (exit code {failure.exitcode}): {message}") from None
    return results[0]
