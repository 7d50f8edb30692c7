"""Work that completes later, in submission order, as on a device stream.

``query()`` is False until the work has been polled enough times or the queue is
advanced; ``wait()`` / ``synchronize()`` complete it (and everything submitted before it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class Completion:
    """A piece of asynchronous work: finishes later, in order with the work before it."""

    def __init__(self, queue: AsyncQueue, on_complete: Callable[[], Any] | None, label: str):
        self._queue = queue
        self._on_complete = on_complete
        self.label = label
        self.done = False
        self.polls = 0
        self.completed_at: float | None = None
        self.result: Any = None

    def _finish(self) -> None:
        if self.done:
            return
        if self._on_complete is not None:
            self.result = self._on_complete()
        self.done = True
        self.completed_at = time.perf_counter()

    def query(self) -> bool:
        """Non-blocking: has it completed? Each poll brings it closer (unless the queue is held)."""
        if not self.done:
            self.polls += 1
            if not self._queue.held and self.polls > self._queue.polls_to_complete:
                self._queue.complete_through(self)
        return self.done

    def wait(self) -> Any:
        """Block until complete (completes all earlier work first)."""
        self._queue.complete_through(self)
        return self.result

    def __repr__(self) -> str:
        return f"<Completion {self.label!r} done={self.done}>"


class AsyncQueue:
    """In-order asynchronous work, as on one device stream.

    ``polls_to_complete``: how many ``query()`` calls return False before the work is done.
    ``held``: while True, polling never completes work (only ``wait``/``advance`` do), which
    lets a test observe the state *before* completion.
    """

    def __init__(self, polls_to_complete: int = 1):
        self.polls_to_complete = polls_to_complete
        self.held = False
        self._pending: list[Completion] = []
        self._lock = threading.RLock()

    def submit(self, on_complete: Callable[[], Any] | None = None, label: str = "") -> Completion:
        c = Completion(self, on_complete, label)
        with self._lock:
            self._pending.append(c)
        return c

    def pending(self) -> list[Completion]:
        with self._lock:
            return list(self._pending)

    def complete_through(self, target: Completion) -> None:
        with self._lock:
            if target.done:
                return
            while self._pending:
                c = self._pending.pop(0)
                c._finish()
                if c is target:
                    return
            target._finish()

    def advance(self, n: int | None = None) -> int:
        """Complete the ``n`` oldest pending items (all when None); returns how many."""
        with self._lock:
            count = len(self._pending) if n is None else min(n, len(self._pending))
            for _ in range(count):
                self._pending.pop(0)._finish()
            return count

    def synchronize(self) -> None:
        self.advance()
