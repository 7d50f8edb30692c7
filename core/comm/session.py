"""The comm session's life: timeout and hooks resolution, ``init_distributed``, ``destroy``, and what is in force.

Before :func:`init_distributed` (and without a process group) a process is a world of one:
:func:`get_rank` is 0 and :func:`get_world_size` is 1.
"""

from __future__ import annotations

import datetime
import math
import os

import torch.distributed as dist

from ..comm_hooks import CommHooks
from ..errors import ConfigError
from ..runtime import current
from . import dispatch, peers, teardown
from .errors import TIMEOUT_ENV
from .staging import StagingStats

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


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

    A group created here is destroyed on every way out of the process (exit, an uncaught exception,
    ``SIGTERM``; :mod:`polyaccel.comm.teardown`); an adopted one is the application's to destroy.
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
    dispatch.install(hooks)


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
    teardown.arm()  # before anything else can fail: the group is ours to end from here on
    peers.publish()


def destroy() -> None:
    """Tear down every process group and forget the session (safe to call twice)."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        teardown.disarm()
        current().comm.end()
        dispatch.install(None)


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
    dispatch.install(hooks)
    return previous


def staging_stats() -> StagingStats:
    """Counters of the staging pool (allocations, reuses, copies in and back)."""
    return dispatch.staging_pool().stats


def refresh() -> None:
    """Re-read which ``polyaccel_collective`` wrappers are registered (done by init and by tracers)."""
    dispatch.install(current().comm.hooks)
