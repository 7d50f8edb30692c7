"""``polyaccel.comm``: a thin layer over ``torch.distributed`` shaped by the selected plugin's comm hooks.

Launch with ``torchrun`` (or :func:`polyaccel.testing.multiprocess.run_ranks` in tests) and call
:func:`init_distributed`; every collective keeps ``torch.distributed``'s signature.

What this layer adds to c10d, and only where it is asked for:

- the backend name and ``device_id`` policy come from the plugin's :class:`CommHooks`;
- a 10-minute default timeout (argument, or ``POLYACCEL_COMM_TIMEOUT`` seconds) applied to the
  world and to every :func:`new_group`, and c10d failures re-raised as :class:`CommError` subclasses
  that say what probably happened (timeout, lost peer);
- truly asynchronous ``isend``/``irecv`` returning :class:`CommHandle` objects;
- host staging for backends that cannot read device memory, and emulation of collectives a
  backend lacks (both declared by the hooks);
- an optional pluggy wrapper hook (``polyaccel_collective``) around every collective and p2p call,
  e.g. :class:`polyaccel.comm.tracing.CommTracer`.

The untraced, unstaged path is one flag test and a direct call into ``torch.distributed``
(measured by ``benchmarks/comm_overhead.py``). Tracing wrappers are looked up when the layer is
initialised or a tracer is entered; call :func:`refresh` after registering a wrapper plugin later.

Before :func:`init_distributed` (and without a process group) a process is a world of one:
:func:`get_rank` is 0 and :func:`get_world_size` is 1.
"""

from __future__ import annotations

from ..comm_hooks import EMULATIONS, CommHooks
from .collectives import (
    ReduceOp,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    new_group,
    reduce_scatter_tensor,
)
from .errors import TIMEOUT_ENV, CommArgumentError, CommError, CommTimeoutError, PeerLostError
from .handles import CommHandle, wait_all
from .p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .session import (
    DEFAULT_TIMEOUT,
    active_hooks,
    destroy,
    get_rank,
    get_timeout,
    get_world_size,
    init_distributed,
    is_initialized,
    refresh,
    resolve_hooks,
    resolve_timeout,
    set_hooks,
    staging_stats,
)
from .staging import StagingStats

__all__ = [
    "DEFAULT_TIMEOUT", "EMULATIONS", "TIMEOUT_ENV", "CommArgumentError", "CommError", "CommHandle", "CommHooks",
    "CommTimeoutError", "P2POp", "PeerLostError", "ReduceOp", "StagingStats", "active_hooks",
    "all_gather_into_tensor", "all_reduce", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
    "destroy", "get_rank", "get_timeout", "get_world_size", "init_distributed", "irecv", "is_initialized", "isend",
    "new_group", "recv", "reduce_scatter_tensor", "refresh", "resolve_hooks", "resolve_timeout", "send", "set_hooks",
    "staging_stats", "wait_all",
]
