"""The call path of every collective and p2p call, and the state it reads on each call.

The session (accelerator, hooks, timeout, staging pool) is the runtime's. The module state below
is derived from it by :func:`install` (the only writer) and read by :mod:`.collectives` and
:mod:`.p2p` on every call, so the untraced, unstaged path costs one flag test: ``direct`` then
means a direct call into ``torch.distributed`` through :func:`call`; otherwise :func:`invoke`
runs the full path (tracing wrapper, staging, emulation, handle wrapping).
"""

from __future__ import annotations

from ..comm_hooks import CommHooks
from ..runtime import current
from . import wrappers
from .errors import translate
from .handles import CommHandle
from .staging import OUT, StagingPool, run_staged

direct = True  # no tracing wrapper and nothing to stage: call torch.distributed straight away
emulated: frozenset[str] = frozenset()  # collectives the hooks in force emulate (polyaccel.comm.fallbacks)
hook_caller = None  # pluggy HookCaller of polyaccel_collective while a wrapper is registered
timeout_s: float | None = None  # the session's timeout in seconds, given to every CommHandle


def install(hooks: CommHooks | None) -> None:
    """Make ``hooks`` the session's and derive the per-call state from them and the registered wrappers."""
    global direct, emulated, hook_caller, timeout_s
    runtime = current()
    runtime.comm.hooks = hooks
    timeout_s = runtime.comm.timeout.total_seconds() if runtime.comm.timeout is not None else None
    hook_caller = wrappers.wrapper_caller(runtime.plugins().pm)
    emulated = hooks.emulated_collectives if hooks is not None else frozenset()
    direct = hook_caller is None and (hooks is None or not hooks.stages)


def session_accelerator():
    """The session's accelerator; before :func:`init_distributed`, the selected one."""
    runtime = current()
    return runtime.comm.accelerator or runtime.accelerator()


def staging_pool() -> StagingPool:
    """The session's host buffers for staged collectives, made on first use."""
    session = current().comm
    if session.staging_pool is None:
        session.staging_pool = StagingPool(session_accelerator())
    return session.staging_pool


def call(op: str, fn, *args):
    """``fn(*args)``, a c10d failure re-raised as the :class:`CommError` that says what happened.

    Positional arguments only: this wraps every direct call, and keywords cost time there.
    """
    try:
        return fn(*args)
    except Exception as exc:
        err = translate(op, exc, timeout_s)
        if err is exc:
            raise
        raise err from exc


def wrap(op: str, work):
    """A c10d work object as a :class:`CommHandle` (None for a blocking call)."""
    return None if work is None else CommHandle(op, (work,), None, timeout_s)


def invoke(op: str, group, entries: tuple, launch, async_op: bool):
    """The full path: tracing wrapper, staging, emulation and handle wrapping."""

    def run():
        hooks = current().comm.hooks
        accelerator = session_accelerator() if hooks is not None and hooks.stages else None
        if accelerator is not None and any(hooks.needs_staging(t, accelerator) for t, _ in entries):
            result = call(op, lambda: run_staged(op, entries, launch, pool=staging_pool(),
                                                  needs_staging=lambda t: hooks.needs_staging(t, accelerator),
                                                  accelerator=accelerator, timeout_s=timeout_s))
        else:
            result = call(op, launch, [t for t, _ in entries], async_op)
            if result is None or isinstance(result, int):
                return result
        handle = result if isinstance(result, CommHandle) else CommHandle(op, (result,), None, timeout_s)
        if async_op:
            return handle
        handle.wait()
        return None

    caller = hook_caller
    if caller is None:
        return run()
    # what this rank contributes; a receive's buffer when it contributes nothing (recv, broadcast's destinations)
    payload = tuple(t for t, role in entries if role != OUT) or tuple(t for t, _ in entries)
    return caller(op=op, group=group, tensors=payload, call=run)
