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

import datetime
import math
import operator
import os

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..runtime import current
from . import fallbacks, peers, wrappers
from .errors import TIMEOUT_ENV, CommArgumentError, CommError, CommTimeoutError, PeerLostError, translate
from .handles import CommHandle, wait_all
from .hooks import EMULATIONS, CommHooks
from .staging import IN, INOUT, OUT, StagingPool, StagingStats, run_staged

ReduceOp = dist.ReduceOp
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)

__all__ = [
    "DEFAULT_TIMEOUT", "EMULATIONS", "TIMEOUT_ENV", "CommArgumentError", "CommError", "CommHandle", "CommHooks",
    "CommTimeoutError", "P2POp", "PeerLostError", "ReduceOp", "StagingStats", "active_hooks",
    "all_gather_into_tensor", "all_reduce", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
    "destroy", "get_rank", "get_timeout", "get_world_size", "init_distributed", "irecv", "is_initialized", "isend",
    "new_group", "recv", "reduce_scatter_tensor", "refresh", "resolve_timeout", "send", "set_hooks", "staging_stats",
    "wait_all",
]


# The session (accelerator, hooks, timeout, staging pool) is the runtime's. What follows is derived
# from it by _install() and read on every call, so the untraced, unstaged path costs one flag test.
_direct = True  # no tracing wrapper and nothing to stage: call torch.distributed straight away
_emulated: frozenset[str] = frozenset()
_hook_caller = None  # pluggy HookCaller of polyaccel_collective while a wrapper is registered
_timeout_s: float | None = None  # the session's timeout in seconds, given to every CommHandle

# torch >= 2.10 renamed these two (the old names warn)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------------------------------- lifecycle
def resolve_timeout(timeout: datetime.timedelta | float | int | None = None) -> datetime.timedelta:
    """The collective timeout: ``timeout`` if given, else ``POLYACCEL_COMM_TIMEOUT`` seconds, else 10 min."""
    origin = "timeout"
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT
        origin = TIMEOUT_ENV
        try:
            timeout = float(raw)
        except ValueError:
            raise ConfigError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; set e.g. {TIMEOUT_ENV}=600") from None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ConfigError(f"{origin} must be seconds or a datetime.timedelta, got {type(timeout).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{origin} must be a positive, finite number of seconds, got {seconds!r}")
    return datetime.timedelta(seconds=seconds)


def resolve_hooks(accelerator, plugin_set=None) -> CommHooks:
    """The comm hooks for ``accelerator``: a plugin's override (``polyaccel_comm_hooks``), else its own."""
    if plugin_set is None:
        plugin_set = current().plugins()
    try:
        hooks = plugin_set.pm.hook.polyaccel_comm_hooks(accelerator=accelerator)
    except Exception as exc:
        raise ConfigError(
            f"a plugin's polyaccel_comm_hooks raised for accelerator {accelerator.name!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if hooks is None:
        hooks = accelerator.comm_hooks()
        if not isinstance(hooks, CommHooks):
            raise ConfigError(f"{type(accelerator).__name__}.comm_hooks() returned {type(hooks).__name__}; "
                              "return a polyaccel.comm.CommHooks")
    elif not isinstance(hooks, CommHooks):
        raise ConfigError(
            f"polyaccel_comm_hooks for accelerator {accelerator.name!r} returned {type(hooks).__name__}; "
            "return a polyaccel.comm.CommHooks (or None for the defaults)"
        )
    return hooks


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | float | None = None, *,
                     init_method: str = "env://", rank: int | None = None, world_size: int | None = None) -> None:
    """Create the world process group for the selected accelerator (idempotent).

    ``backend`` overrides the comm hooks' backend name. When a process group already exists
    (created by us or by the application) it is adopted and nothing is re-created.
    """
    runtime = current()
    session = runtime.comm
    if session.active and dist.is_initialized():
        return
    accelerator = runtime.accelerator()
    hooks = resolve_hooks(accelerator, runtime.plugins())
    limit = resolve_timeout(timeout)
    owned = not dist.is_initialized()
    if owned:
        _init_process_group(accelerator, hooks, backend, limit, init_method, rank, world_size)
    session.accelerator, session.timeout, session.owned = accelerator, limit, owned
    _install(hooks)


def _init_process_group(accelerator, hooks: CommHooks, backend: str | None, timeout: datetime.timedelta,
                        init_method: str, rank: int | None, world_size: int | None) -> None:
    kwargs: dict = {"backend": backend or hooks.backend, "init_method": init_method, "timeout": timeout}
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    if hooks.pass_device_id:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        accelerator.set_device(local_rank)
        kwargs["device_id"] = accelerator.device(local_rank)
    dist.init_process_group(**kwargs)
    peers.publish()


def destroy() -> None:
    """Tear down every process group and forget the session (safe to call twice)."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        current().comm.end()
        _install(None)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    if group is None and not is_initialized():
        return 0
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    if group is None and not is_initialized():
        return 1
    return dist.get_world_size(group)


def get_timeout() -> datetime.timedelta:
    """The timeout the world group was created with (or the one init_distributed would use)."""
    timeout = current().comm.timeout
    return timeout if timeout is not None else resolve_timeout()


def active_hooks() -> CommHooks | None:
    """The comm hooks in force (None before :func:`init_distributed`: plain torch.distributed)."""
    return current().comm.hooks


def set_hooks(hooks: CommHooks | None) -> CommHooks | None:
    """Replace the active comm hooks (staging, emulation) and return the previous ones.

    For tests and embedding applications; ``backend`` and ``pass_device_id`` only matter at
    :func:`init_distributed`. ``None`` goes back to plain calls.
    """
    previous = current().comm.hooks
    if hooks is not None and not isinstance(hooks, CommHooks):
        raise ConfigError(f"set_hooks expects a polyaccel.comm.CommHooks or None, got {type(hooks).__name__}")
    _install(hooks)
    return previous


def staging_stats() -> StagingStats:
    """Counters of the staging pool (allocations, reuses, copies in and back)."""
    return _staging_pool().stats


def refresh() -> None:
    """Re-read which ``polyaccel_collective`` wrappers are registered (done by init and by tracers)."""
    _install(current().comm.hooks)


def _accelerator():
    """The session's accelerator; before :func:`init_distributed`, the selected one."""
    runtime = current()
    return runtime.comm.accelerator or runtime.accelerator()


def _staging_pool() -> StagingPool:
    session = current().comm
    if session.staging_pool is None:
        session.staging_pool = StagingPool(_accelerator())
    return session.staging_pool


def _install(hooks: CommHooks | None) -> None:
    global _direct, _emulated, _hook_caller, _timeout_s
    runtime = current()
    runtime.comm.hooks = hooks
    _timeout_s = runtime.comm.timeout.total_seconds() if runtime.comm.timeout is not None else None
    _hook_caller = wrappers.wrapper_caller(runtime.plugins().pm)
    _emulated = hooks.emulated_collectives if hooks is not None else frozenset()
    _direct = _hook_caller is None and (hooks is None or not hooks.stages)


# ---------------------------------------------------------------------------------------- dispatch
def _call(op: str, fn, *args):
    """``fn(*args)``, a c10d failure re-raised as the :class:`CommError` that says what happened.

    Positional arguments only: this wraps every direct call, and keywords cost time there.
    """
    try:
        return fn(*args)
    except Exception as exc:
        err = translate(op, exc, _timeout_s)
        if err is exc:
            raise
        raise err from exc


def _wrap(op: str, work):
    return None if work is None else CommHandle(op, (work,), None, _timeout_s)


def _invoke(op: str, group, entries: tuple, launch, async_op: bool):
    """The full path: tracing wrapper, staging, emulation and handle wrapping."""

    def call():
        hooks = current().comm.hooks
        accelerator = _accelerator() if hooks is not None and hooks.stages else None
        if accelerator is not None and any(hooks.needs_staging(t, accelerator) for t, _ in entries):
            result = _call(op, lambda: run_staged(op, entries, launch, pool=_staging_pool(),
                                                  needs_staging=lambda t: hooks.needs_staging(t, accelerator),
                                                  accelerator=accelerator, timeout_s=_timeout_s))
        else:
            result = _call(op, launch, [t for t, _ in entries], async_op)
            if result is None or isinstance(result, int):
                return result
        handle = result if isinstance(result, CommHandle) else CommHandle(op, (result,), None, _timeout_s)
        if async_op:
            return handle
        handle.wait()
        return None

    caller = _hook_caller
    if caller is None:
        return call()
    # what this rank contributes; a receive's buffer when it contributes nothing (recv, broadcast's destinations)
    payload = tuple(t for t, role in entries if role != OUT) or tuple(t for t, _ in entries)
    return caller(op=op, group=group, tensors=payload, call=call)


# ---------------------------------------------------------------------------------------- argument checks
def _bad(op: str, message: str):
    raise CommArgumentError(f"polyaccel.comm.{op}: {message}")


def _check_same_dtype(op: str, out_name: str, output: torch.Tensor, in_name: str, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        _bad(op, f"{out_name} has dtype {output.dtype} but {in_name} has dtype {input.dtype}; "
                 f"allocate {out_name} with dtype={input.dtype}")


def _check_splits(op: str, name: str, splits, tensor: torch.Tensor, tensor_name: str, world: int) -> None:
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if rows % world:
            _bad(op, f"{tensor_name} has {rows} rows, not divisible by the group size {world}; "
                     f"pass {name} explicitly")
        return
    try:
        splits = [operator.index(s) for s in splits]
    except TypeError:
        _bad(op, f"{name} must be a list of non-negative ints, got {splits!r}")
    if len(splits) != world:
        _bad(op, f"{name} has {len(splits)} entries but the group has {world} ranks; give one size per rank")
    if any(s < 0 for s in splits):
        _bad(op, f"{name} must be non-negative ints, got {splits}")
    if sum(splits) != rows:
        _bad(op, f"{name} {splits} sums to {sum(splits)} but {tensor_name} has {rows} rows (dim 0); "
                 "the sizes must add up to dim 0")


# ---------------------------------------------------------------------------------------- collectives
def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if _direct:
        return _wrap("all_reduce", _call("all_reduce", dist.all_reduce, tensor, op, group, async_op))
    return _invoke("all_reduce", group, ((tensor, INOUT),), lambda ts, a: dist.all_reduce(ts[0], op, group, a),
                   async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    name = "reduce_scatter_tensor"
    _check_same_dtype(name, "output", output, "input", input)
    world = get_world_size(group)
    if input.numel() != output.numel() * world:
        _bad(name, f"input has {input.numel()} elements but must have output.numel() * group size = "
                   f"{output.numel()} * {world} = {output.numel() * world}")
    if name in _emulated:
        launch = lambda ts, a: fallbacks.reduce_scatter_tensor(ts[0], ts[1], op, group, _timeout_s)
    elif _direct:
        return _wrap(name, _call(name, _reduce_scatter, output, input, op, group, async_op))
    else:
        launch = lambda ts, a: _reduce_scatter(ts[0], ts[1], op, group, a)
    return _invoke(name, group, ((output, OUT), (input, IN)), launch, async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                           async_op: bool = False):
    name = "all_gather_into_tensor"
    _check_same_dtype(name, "output_tensor", output_tensor, "input_tensor", input_tensor)
    world = get_world_size(group)
    if output_tensor.numel() != input_tensor.numel() * world:
        _bad(name, f"output_tensor has {output_tensor.numel()} elements but must have input_tensor.numel() * "
                   f"group size = {input_tensor.numel()} * {world} = {input_tensor.numel() * world}")
    if name in _emulated:
        launch = lambda ts, a: fallbacks.all_gather_into_tensor(ts[0], ts[1], group, _timeout_s)
    elif _direct:
        return _wrap(name, _call(name, _all_gather, output_tensor, input_tensor, group, async_op))
    else:
        launch = lambda ts, a: _all_gather(ts[0], ts[1], group, a)
    return _invoke(name, group, ((output_tensor, OUT), (input_tensor, IN)), launch, async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False):
    """Uneven splits (including zeros) along dim 0; split lists are checked before anything is sent."""
    name = "all_to_all_single"
    _check_same_dtype(name, "output", output, "input", input)
    world = get_world_size(group)
    _check_splits(name, "input_split_sizes", input_split_sizes, input, "input", world)
    _check_splits(name, "output_split_sizes", output_split_sizes, output, "output", world)
    if input.dim() and output.dim() and input.shape[1:] != output.shape[1:]:
        _bad(name, f"output rows have shape {tuple(output.shape[1:])} but input rows {tuple(input.shape[1:])}; "
                   "all dims but the first must match")
    if name in _emulated:
        launch = lambda ts, a: fallbacks.all_to_all_single(ts[0], ts[1], output_split_sizes, input_split_sizes,
                                                           group, _timeout_s)
    elif _direct:
        return _wrap(name, _call(name, dist.all_to_all_single, output, input, output_split_sizes, input_split_sizes,
                                 group, async_op))
    else:
        launch = lambda ts, a: dist.all_to_all_single(ts[0], ts[1], output_split_sizes, input_split_sizes, group, a)
    return _invoke(name, group, ((output, OUT), (input, IN)), launch, async_op)


def broadcast(tensor: torch.Tensor, src: int | None = None, group=None, async_op: bool = False,
              group_src: int | None = None):
    if _direct:
        return _wrap("broadcast", _call("broadcast", dist.broadcast, tensor, src, group, async_op, group_src))
    is_src = get_rank(group) == group_src if src is None else get_rank() == src
    return _invoke("broadcast", group, ((tensor, IN if is_src else OUT),),
                   lambda ts, a: dist.broadcast(ts[0], src, group, a, group_src=group_src), async_op)


def barrier(group=None, async_op: bool = False):
    if _direct:
        return _wrap("barrier", _call("barrier", dist.barrier, group, async_op))
    return _invoke("barrier", group, (), lambda ts, a: dist.barrier(group, a), async_op)


def new_group(ranks=None, timeout=None, backend=None, **kwargs):
    """``torch.distributed.new_group`` that inherits this layer's timeout instead of torch's default."""
    return dist.new_group(ranks, timeout=timeout if timeout is not None else get_timeout(),
                          backend=backend, **kwargs)


# ---------------------------------------------------------------------------------------- point to point
def send(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None):
    if _direct:
        return _call("send", dist.send, tensor, dst, group, tag, group_dst)
    _invoke("send", group, ((tensor, IN),), lambda ts, a: dist.isend(ts[0], dst, group, tag, group_dst), False)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None):
    """Blocking receive; returns the sender's rank like torch (``src`` as given when staged)."""
    if _direct:
        return _call("recv", dist.recv, tensor, src, group, tag, group_src)
    _invoke("recv", group, ((tensor, OUT),), lambda ts, a: dist.irecv(ts[0], src, group, tag, group_src), False)
    return src if src is not None else group_src


def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0,
          group_dst: int | None = None) -> CommHandle:
    """Non-blocking send: returns at once with a handle; the tensor must not change until ``wait()``."""
    if _direct:
        return CommHandle("isend", (_call("isend", dist.isend, tensor, dst, group, tag, group_dst),), None, _timeout_s)
    return _invoke("isend", group, ((tensor, IN),), lambda ts, a: dist.isend(ts[0], dst, group, tag, group_dst),
                   True)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0,
          group_src: int | None = None) -> CommHandle:
    """Non-blocking receive: returns at once; ``tensor`` holds the data after ``wait()``."""
    if _direct:
        return CommHandle("irecv", (_call("irecv", dist.irecv, tensor, src, group, tag, group_src),), None, _timeout_s)
    return _invoke("irecv", group, ((tensor, OUT),), lambda ts, a: dist.irecv(ts[0], src, group, tag, group_src),
                   True)


def P2POp(op, tensor: torch.Tensor, peer: int | None = None, group=None, tag: int = 0,
          group_peer: int | None = None) -> dist.P2POp:
    """``torch.distributed.P2POp``; ``op`` may be this module's or torch's ``isend``/``irecv``."""
    op = {isend: dist.isend, irecv: dist.irecv}.get(op, op)
    return dist.P2POp(op, tensor, peer, group, tag, group_peer)


def batch_isend_irecv(p2p_op_list) -> list[CommHandle]:
    """Post a batch of sends and receives at once; returns handles to wait on (one per op when not staged)."""
    ops = list(p2p_op_list)
    if not ops:
        return []
    if _direct:
        works = _call("batch_isend_irecv", dist.batch_isend_irecv, ops)
        return [CommHandle("batch_isend_irecv", (w,), None, _timeout_s) for w in works]
    entries = tuple((p.tensor, IN if p.op is dist.isend else OUT) for p in ops)

    def launch(ts, a):
        staged = [dist.P2POp(p.op, t, p.peer, p.group, p.tag)
                  for p, t in zip(ops, ts, strict=True)]
        return CommHandle("batch_isend_irecv", dist.batch_isend_irecv(staged), None, _timeout_s)

    return [_invoke("batch_isend_irecv", ops[0].group, entries, launch, True)]
