"""Device streams and events of an emulated runtime, each stream an :class:`~.completion.AsyncQueue`."""

from __future__ import annotations

from typing import Any

from .completion import AsyncQueue, Completion
from .marker import mark_emulated


class EmulatedEvent:
    """A device event on an :class:`AsyncQueue`: recorded, queried, waited on, timed."""

    def __init__(self, runtime: Any, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self._runtime = runtime
        self.enable_timing = enable_timing
        self._completion: Completion | None = None
        mark_emulated(self)

    def record(self, stream: EmulatedStream | None = None) -> None:
        stream = stream or self._runtime.current_stream()
        self._runtime.record("Event.record", stream.stream_id)
        self._completion = stream.queue.submit(label="event")

    def query(self) -> bool:
        return True if self._completion is None else self._completion.query()

    def synchronize(self) -> None:
        if self._completion is not None:
            self._completion.wait()

    def wait(self, stream: EmulatedStream | None = None) -> None:
        """Make ``stream`` wait for this event (device side). Emulated: completes it first."""
        self._runtime.record("Event.wait")
        self.synchronize()

    def elapsed_time(self, end: EmulatedEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with enable_timing=True to measure elapsed time")
        if self._completion is None or end._completion is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        if not (self._completion.done and end._completion.done):
            raise RuntimeError("Both events must be completed before calculating elapsed time")
        return (end._completion.completed_at - self._completion.completed_at) * 1000.0


class EmulatedStream:
    """A device stream: its own in-order queue of work."""

    _next_id = 0

    def __init__(self, runtime: Any, device: Any = None, priority: int = 0, **kwargs):
        self._runtime = runtime
        EmulatedStream._next_id += 1
        self.stream_id = EmulatedStream._next_id
        self.priority = priority
        self.device = device
        self.queue = AsyncQueue(runtime.polls_to_complete)
        mark_emulated(self)

    def query(self) -> bool:
        return all(c.query() for c in self.queue.pending())

    def synchronize(self) -> None:
        self._runtime.record("Stream.synchronize", self.stream_id)
        self.queue.synchronize()

    def wait_stream(self, other: EmulatedStream) -> None:
        self._runtime.record("Stream.wait_stream", self.stream_id, other.stream_id)
        other.queue.synchronize()

    def wait_event(self, event: EmulatedEvent) -> None:
        self._runtime.record("Stream.wait_event", self.stream_id)
        event.synchronize()

    def record_event(self, event: EmulatedEvent | None = None) -> EmulatedEvent:
        event = event or EmulatedEvent(self._runtime)
        event.record(self)
        return event

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EmulatedStream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(self.stream_id)

    def __repr__(self) -> str:
        return f"<EmulatedStream {self.stream_id} of {self._runtime.name}>"
