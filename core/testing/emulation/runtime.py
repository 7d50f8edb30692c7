"""The base of every emulated runtime: call log, faults, default stream, memory counters, activation."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from .accelerator import emulate_accelerator
from .calls import CallLog, CallRecord
from .faults import Faults
from .marker import EMULATED
from .memory import AllocationTracker, MemoryCounters
from .patching import Patcher
from .streams import EmulatedStream

if TYPE_CHECKING:
    from polyaccel.accelerator import Accelerator


class EmulatedRuntime(abc.ABC):
    """Base of every emulated vendor runtime.

    Subclasses set ``name`` (the name of the accelerator they stand in for), ``accelerator``
    (that accelerator's class, made an emulated one while the runtime is active; None for a
    runtime no accelerator of its own uses), ``FAULTS`` (switch name -> what it does) and
    implement :meth:`install`. ``calls`` records every runtime call; ``label`` is
    :data:`~.marker.EMULATED`. ``MyRuntime.emulate(**options)`` is the ``with`` block that
    installs one; a plugin offers the class through the ``polyaccel_emulated_runtimes`` hook.
    """

    name: ClassVar[str] = ""
    accelerator: ClassVar[type[Accelerator] | None] = None
    FAULTS: ClassVar[Mapping[str, str]] = {}
    label = EMULATED

    def __init__(self, polls_to_complete: int = 1, **faults: Any):
        self.faults = Faults(self.name, self.FAULTS, faults)
        self.calls = CallLog()
        self.polls_to_complete = polls_to_complete
        self.memory = MemoryCounters()
        self._default_stream: EmulatedStream | None = None
        self._current_stream: EmulatedStream | None = None
        self.active = False

    @classmethod
    def emulate(cls, **options: Any) -> contextlib.AbstractContextManager[EmulatedRuntime]:
        """Install a runtime built with ``options`` (and fault switches) for a ``with`` block; yields it."""
        return cls(**options).activate()

    def record(self, name: str, *args: Any, result: Any = None, **kwargs: Any) -> CallRecord:
        rec = CallRecord(name, args, dict(kwargs), result)
        self.calls.append(rec)
        return rec

    # default stream handling shared by all runtimes
    def default_stream(self) -> EmulatedStream:
        if self._default_stream is None:
            self._default_stream = EmulatedStream(self)
        return self._default_stream

    def current_stream(self) -> EmulatedStream:
        return self._current_stream or self.default_stream()

    @contextlib.contextmanager
    def use_stream(self, stream: EmulatedStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        prev = self._current_stream
        self._current_stream = stream
        try:
            yield
        finally:
            self._current_stream = prev

    def synchronize_all(self) -> None:
        self.default_stream().queue.synchronize()
        if self._current_stream is not None:
            self._current_stream.queue.synchronize()

    def install_allocation_tracking(self, patcher: Patcher) -> None:
        """Feed ``self.memory`` from the storages created while the emulation is active."""
        tracker = AllocationTracker(self.memory)
        tracker.__enter__()
        patcher.on_exit(lambda: tracker.__exit__(None, None, None))

    @abc.abstractmethod
    def install(self, patcher: Patcher) -> None:
        """Install the stand-in through ``patcher`` (fake modules, torch attributes)."""

    @contextlib.contextmanager
    def activate(self) -> Iterator[EmulatedRuntime]:
        with Patcher() as patcher:
            self.install(patcher)
            if self.accelerator is not None:
                emulate_accelerator(patcher, self.accelerator)
            patcher.refresh()
            self.active = True
            try:
                yield self
            finally:
                self.active = False

    def __repr__(self) -> str:
        return f"<emulated {self.name} runtime, faults={self.faults.active()}, {len(self.calls)} calls>"


def missing_library_error(library: str, package: str) -> ImportError:
    """The ImportError a vendor extension ``package`` raises when its native ``library`` is not installed."""
    err = ImportError(f"{library}: cannot open shared object file: No such file or directory")
    err.name = package
    return err


def emulation_fixture(emulate: Callable[..., contextlib.AbstractContextManager], **options: Any):
    """Build a pytest fixture that runs a test inside ``emulate(**options)`` and yields the runtime."""
    import pytest

    @pytest.fixture
    def _fixture():
        with emulate(**options) as runtime:
            yield runtime

    return _fixture
