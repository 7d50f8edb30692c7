"""Tracing of collectives through the ``polyaccel_collective`` wrapper hook.

Any plugin may wrap every collective and p2p call of ``polyaccel.comm`` with
``@hookimpl(wrapper=True) def polyaccel_collective(op, group, tensors, call): ... yield ...``.
The comm layer routes calls through pluggy only while at least one such wrapper is
registered, so an untraced program pays nothing. :class:`CommTracer` is the built-in one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..hookspecs import hookimpl
from ..runtime import current
from .session import refresh


def group_ranks(group) -> tuple[int, ...]:
    """Global ranks of ``group`` (None = the world)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return (0,)
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


@dataclass(frozen=True)
class CommEvent:
    """One traced call.

    ``bytes`` counts what this rank contributes (the input of a collective, the payload of
    a send), or what it receives when it contributes nothing (recv, a broadcast's
    destinations). ``duration_s`` is the wall time of the call; for an async call
    (``async_op``) that is the time to post it, not to complete it. ``ok`` is False when
    the call raised.
    """

    op: str
    group_ranks: tuple[int, ...]
    bytes: int
    duration_s: float
    async_op: bool
    dtypes: tuple[str, ...]
    ok: bool = True


class CommTracer:
    """Records every ``polyaccel.comm`` call made while it is entered.

    >>> with CommTracer() as tracer:
    ...     comm.all_reduce(t)
    >>> [e.op for e in tracer.events]
    ['all_reduce']
    """

    def __init__(self) -> None:
        self.events: list[CommEvent] = []
        self._pm = None

    @hookimpl(wrapper=True)
    def polyaccel_collective(self, op, group, tensors):
        start = time.perf_counter()
        ok = False
        result = None
        try:
            result = yield
            ok = True
            return result
        finally:
            self.events.append(CommEvent(
                op=op,
                group_ranks=group_ranks(group),
                bytes=sum(t.numel() * t.element_size() for t in tensors),
                duration_s=time.perf_counter() - start,
                async_op=hasattr(result, "wait") or isinstance(result, list),
                dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
                ok=ok,
            ))

    def ops(self) -> list[str]:
        """The op names in call order: the schedule tests assert."""
        return [e.op for e in self.events]

    def total_bytes(self, op: str | None = None) -> int:
        return sum(e.bytes for e in self.events if op is None or e.op == op)

    def clear(self) -> None:
        self.events.clear()

    def __enter__(self) -> CommTracer:
        self._pm = current().plugins().pm
        self._pm.register(self, name=f"polyaccel.comm.tracer.{id(self)}")
        refresh()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._pm is not None and self._pm.is_registered(self):
            self._pm.unregister(self)
        self._pm = None
        refresh()
