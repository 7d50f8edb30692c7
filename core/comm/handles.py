"""Work handles returned by async calls of ``polyaccel.comm``.

A :class:`CommHandle` wraps one or more c10d ``Work`` objects plus an optional
*finalizer*: the step that must run after the transfer completed and before the caller
may read the result (copy a staged buffer back, slice an emulated reduce-scatter). The
finalizer runs exactly once, inside :meth:`CommHandle.wait`, never earlier.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

from .errors import translate


class CommHandle:
    __slots__ = ("op", "_works", "_finalize", "_done", "_timeout_s")

    def __init__(self, op: str, works: Sequence, finalize: Callable[[], None] | None = None,
                 timeout_s: float | None = None):
        self.op = op
        self._works = tuple(w for w in works if w is not None)
        self._finalize = finalize
        self._done = False
        self._timeout_s = timeout_s

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the call completed and its results are in the caller's tensors."""
        if self._done:
            return True
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        try:
            for work in self._works:
                if timeout is None:
                    work.wait()
                else:
                    work.wait(timeout)
        except Exception as exc:
            raise translate(self.op, exc, self._timeout_s) from exc
        finalize, self._finalize = self._finalize, None
        self._done = True
        if finalize is not None:
            finalize()
        return True

    def is_completed(self) -> bool:
        """Whether the transfer finished; results reach the caller's tensors only in :meth:`wait`."""
        return self._done or all(w.is_completed() for w in self._works)

    def works(self) -> tuple:
        """The underlying c10d ``Work`` objects."""
        return self._works

    def get_future(self):
        """The c10d future of a single, unstaged, unemulated call."""
        if len(self._works) != 1 or self._finalize is not None:
            raise NotImplementedError(
                f"get_future() is only available for a plain single call; {self.op} here is staged or emulated: "
                "use wait()"
            )
        return self._works[0].get_future()

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"CommHandle({self.op}, {len(self._works)} work(s), {state})"


def wait_all(handles) -> None:
    """Wait for every handle (None entries, from sync calls, are skipped)."""
    for h in handles:
        if h is not None:
            h.wait()
