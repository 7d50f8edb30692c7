"""The ``polyaccel_collective`` wrapper hook: when comm calls go through pluggy, and what runs innermost.

The comm layer routes calls through pluggy only while at least one wrapper (a tracer, a
profiler) is registered; otherwise it calls ``torch.distributed`` directly.
"""

from __future__ import annotations

from ..hookspecs import hookimpl


class _Runner:
    """The innermost implementation: performs the call the wrappers wrap."""

    @hookimpl(trylast=True)
    def polyaccel_collective(self, call):
        return call()


_RUNNER = _Runner()
_RUNNER_NAME = "polyaccel.comm.runner"


def wrapper_caller(pm):
    """The hook caller when a wrapper besides the runner is registered with ``pm``, else None."""
    caller = pm.hook.polyaccel_collective
    if not any(impl.plugin is not _RUNNER for impl in caller.get_hookimpls()):
        return None
    if not pm.is_registered(_RUNNER):
        pm.register(_RUNNER, name=_RUNNER_NAME)
    return caller
