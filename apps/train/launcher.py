"""Start the ranks of a run through torchrun's Python API (``elastic_launch``).

Single node, no restarts: a failing rank ends the run and its error is reported back. The
rendezvous is torchrun's ``--standalone`` one (c10d store on a free local port).
"""

from __future__ import annotations

import contextlib
import logging
import uuid

from polyaccel import errors
from polyaccel.errors import PolyaccelError

from .options import TrainOptions


class RankFailed(PolyaccelError):
    """A rank of ``polyaccel train`` exited with an error.

    ``traceback`` is the failing rank's Python traceback ("" when it left none, e.g. killed by a
    signal); ``expected`` is True when the error is one polyaccel raises on purpose (its message
    says what to fix, so the traceback is noise).
    """

    def __init__(self, message: str, traceback: str = "", expected: bool = False):
        super().__init__(message)
        self.traceback = traceback
        self.expected = expected


@contextlib.contextmanager
def _quiet_agent():
    """The elastic agent logs each failing rank's traceback; the launcher reports the first one itself."""
    logs = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    old = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, old, strict=True):
            log.setLevel(level)


def _is_polyaccel_error(message: str) -> bool:
    name = message.split(":", 1)[0].strip()
    cls = getattr(errors, name, None)
    if cls is None:
        from polyaccel.comm import errors as comm_errors

        cls = getattr(comm_errors, name, None)
    return isinstance(cls, type) and issubclass(cls, PolyaccelError)


def launch(opts: TrainOptions) -> dict:
    """Run ``opts.nproc`` ranks of :func:`worker.rank_main` and return rank 0's result."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
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
        with _quiet_agent():
            results = elastic_launch(config, rank_main)(opts)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message, traceback = failure.message, ""
        if isinstance(message, dict):  # the error file of a @record-ed entry point
            traceback = message.get("extraInfo", {}).get("py_callstack", "")
            message = message.get("message", str(message))
        raise RankFailed(f"rank {rank} failed (exit code {failure.exitcode}): {message}", traceback,
                         _is_polyaccel_error(str(message))) from None
    except SignalException as exc:  # Ctrl-C or a kill reached the launcher; the agent stopped the ranks
        raise RankFailed(f"stopped by signal {exc.sigval.name}; the ranks were terminated", expected=True) from None
    return results[0]
