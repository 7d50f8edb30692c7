"""Reusable pieces for CPU-backed vendor runtime stand-ins.

A concrete emulation (``polyaccel.testing.emulation.<plugin>``) subclasses
:class:`EmulatedRuntime`, declares its fault switches in ``FAULTS``, implements
``install(patcher)`` (put fake modules into ``sys.modules`` and attributes onto ``torch``
through the :class:`Patcher`, which undoes everything on exit) and exposes::

    def emulate(**faults):
        return MyRuntime(**faults).activate()

Building blocks shared by every runtime:

- :class:`CallLog` / :class:`CallRecord`: what the plugin asked the runtime, in order.
- :class:`Faults`: declared switches; an unknown switch name is an error, not ignored.
- :class:`AsyncQueue` / :class:`Completion`: work that completes *later* (in submission
  order), as on a device stream: ``query()`` is False until it has been polled enough
  times or the queue is advanced; ``wait()`` / ``synchronize()`` complete it.
- :class:`EmulatedStream` / :class:`EmulatedEvent`: stream/event objects on that queue.
- :class:`HostMemoryTable`: a runtime's table of registered host ranges with alignment,
  overlap and flag checks returning integer error codes.
- :class:`GraphRecorder`: records the aten ops run during capture and re-runs them on
  replay (writing into the captured output buffers), so replay really recomputes.
- :class:`MemoryCounters`: allocated/reserved/peak counters for memory statistics, fed by
  :class:`AllocationTracker` (every storage created while the emulation is active).
- :class:`PinnedHost`: the runtime's page-locked host allocator (tracked copies), wired to
  ``Tensor.pin_memory()`` / ``Tensor.is_pinned()``.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

#: The label every result produced under emulation carries.
EMULATED = "emulated"

#: Attribute set to True on every fake module/object, so a plugin can tell an emulated
#: runtime from a real one (e.g. to place tensors on the CPU) without importing this kit.
EMULATED_MARKER = "__polyaccel_emulated__"

_MISSING = object()


def is_emulated_module(obj: Any) -> bool:
    """True when ``obj`` is (part of) an emulated runtime installed by this kit."""
    return getattr(obj, EMULATED_MARKER, False) is True


def missing_library_error(library: str = "libhccl.so", package: str = "torch_npu") -> ImportError:
    """The ImportError a vendor extension raises when its native libraries are not installed."""
    err = ImportError(f"{library}: cannot open shared object file: No such file or directory")
    err.name = package
    return err


# --------------------------------------------------------------------------- calls
@dataclass(frozen=True)
class CallRecord:
    """One call the code under test made into the emulated runtime."""

    name: str
    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    result: Any = None


class CallLog(list):
    """Ordered list of :class:`CallRecord` with small query helpers."""

    def names(self) -> list[str]:
        return [c.name for c in self]

    def of(self, name: str) -> list[CallRecord]:
        return [c for c in self if c.name == name]

    def count_of(self, name: str) -> int:
        return sum(1 for c in self if c.name == name)

    def last(self, name: str) -> CallRecord:
        for c in reversed(self):
            if c.name == name:
                return c
        raise LookupError(f"the runtime was never called with {name!r}; calls: {self.names()}")


# -------------------------------------------------------------------------- faults
class Faults:
    """Fault switches of one runtime. Only declared names exist; each defaults to False/None.

    Switches can be flipped mid-test (``runtime.faults.unregister_fails = True``).
    """

    def __init__(self, runtime: str, declared: Mapping[str, str], given: Mapping[str, Any]):
        object.__setattr__(self, "_runtime", runtime)
        object.__setattr__(self, "_declared", dict(declared))
        object.__setattr__(self, "_values", {k: None for k in declared})
        for key, value in given.items():
            setattr(self, key, value)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(self._unknown(name))

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._declared:
            raise TypeError(self._unknown(name))
        self._values[name] = value

    def _unknown(self, name: str) -> str:
        known = ", ".join(f"{k} ({v})" for k, v in self._declared.items()) or "none"
        return f"unknown fault {name!r} for the emulated {self._runtime} runtime; known faults: {known}"

    def active(self) -> dict[str, Any]:
        return {k: v for k, v in self._values.items() if v}

    def __repr__(self) -> str:
        return f"Faults({self._runtime}, {self.active()})"


# ------------------------------------------------------------------ async completion
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


class EmulatedEvent:
    """A device event on an :class:`AsyncQueue`: recorded, queried, waited on, timed."""

    def __init__(self, runtime: EmulatedRuntime, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self._runtime = runtime
        self.enable_timing = enable_timing
        self._completion: Completion | None = None
        setattr(self, EMULATED_MARKER, True)

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

    def __init__(self, runtime: EmulatedRuntime, device: Any = None, priority: int = 0, **kwargs):
        self._runtime = runtime
        EmulatedStream._next_id += 1
        self.stream_id = EmulatedStream._next_id
        self.priority = priority
        self.device = device
        self.queue = AsyncQueue(runtime.polls_to_complete)
        setattr(self, EMULATED_MARKER, True)

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


# ------------------------------------------------------------------- host memory
class HostMemoryTable:
    """Registered host ranges as a runtime keeps them, with integer status codes.

    ``register`` checks alignment (address and length multiples of ``alignment``), flags
    and overlap; the codes are the runtime's own (given by the subclassing runtime).
    """

    def __init__(self, alignment: int, ok: int = 0, invalid_value: int = 1, already_registered: int = 2,
                 not_registered: int = 3):
        self.alignment = alignment
        self.ok = ok
        self.invalid_value = invalid_value
        self.already_registered = already_registered
        self.not_registered = not_registered
        self.ranges: dict[int, tuple[int, int]] = {}  # ptr -> (nbytes, flags)

    def register(self, ptr: int, nbytes: int, flags: int, allowed_flags: tuple[int, ...]) -> int:
        if ptr <= 0 or nbytes <= 0 or ptr % self.alignment or nbytes % self.alignment:
            return self.invalid_value
        if flags not in allowed_flags:
            return self.invalid_value
        for p, (n, _) in self.ranges.items():
            if ptr < p + n and p < ptr + nbytes:
                return self.already_registered
        self.ranges[ptr] = (nbytes, flags)
        return self.ok

    def unregister(self, ptr: int) -> int:
        if ptr not in self.ranges:
            return self.not_registered
        del self.ranges[ptr]
        return self.ok

    def covers(self, ptr: int, nbytes: int) -> bool:
        return any(p <= ptr and ptr + nbytes <= p + n for p, (n, _) in self.ranges.items())


# ------------------------------------------------------------------------- graphs
class GraphCaptureError(RuntimeError):
    pass


class _RecordingMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise GraphCaptureError(
                "operation not permitted when stream is capturing: a host synchronisation "
                "(.item(), printing a tensor, data-dependent control flow) inside graph capture"
            )
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


class GraphRecorder:
    """Capture = record the aten ops run on the host; replay = run them again.

    Each replay re-executes the recorded ops against the *same* tensors (the static
    inputs and every intermediate the capture allocated) and writes results into the
    captured outputs, so a replay after changing an input's contents recomputes, exactly
    as a device graph does. A host sync inside capture raises, as on device.
    """

    def __init__(self) -> None:
        self.ops: list = []
        self.captured = False
        self.replays = 0
        self._mode: _RecordingMode | None = None

    def begin(self) -> None:
        if self.captured:
            raise GraphCaptureError("this graph was already captured; create a new graph to capture again")
        self._mode = _RecordingMode(self.ops)
        self._mode.__enter__()

    def end(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self.captured = True

    def replay(self) -> None:
        if not self.captured:
            raise GraphCaptureError("replay() before capture: capture work into the graph first")
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                fresh = func(*args, **kwargs)
                for dst, src in zip(_tensors(out), _tensors(fresh), strict=True):
                    if dst is not src and dst.data_ptr() != src.data_ptr():
                        dst.copy_(src)
        self.replays += 1

    def reset(self) -> None:
        self.ops.clear()
        self.captured = False


class EmulatedGraph:
    """A vendor's device-graph class (``torch.npu.NPUGraph``, ``torch.supa.SUPAGraph``) on a
    :class:`GraphRecorder`: capture records, replay really recomputes. Subclasses set ``api_name``,
    the name under which the runtime records the calls."""

    api_name = "Graph"

    def __init__(self, runtime: EmulatedRuntime):
        self._rt = runtime
        self._rec = GraphRecorder()
        setattr(self, EMULATED_MARKER, True)

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        self._rt.record(f"{self.api_name}.capture_begin")
        self._rec.begin()

    def capture_end(self) -> None:
        self._rec.end()
        self._rt.record(f"{self.api_name}.capture_end", len(self._rec.ops))

    def replay(self) -> None:
        self._rt.record(f"{self.api_name}.replay")
        self._rec.replay()

    def reset(self) -> None:
        self._rec.reset()

    def pool(self) -> tuple[int, int]:
        return (id(self), 0)

    @property
    def replays(self) -> int:
        return self._rec.replays


def install_graph_api(module: Any, rt: EmulatedRuntime, graph_cls: type[EmulatedGraph]) -> None:
    """Give an emulated ``torch.<device>`` module ``<api_name>()``, ``graph(g, pool, stream)`` and
    ``graph_pool_handle()``; created graphs are kept in ``rt.graphs``."""

    def make_graph() -> EmulatedGraph:
        g = graph_cls(rt)
        rt.graphs.append(g)
        return g

    @contextlib.contextmanager
    def graph(device_graph: EmulatedGraph, pool=None, stream=None, capture_error_mode: str = "global"):
        rt.record("graph", pool=pool, stream=stream)
        with rt.use_stream(stream):
            device_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
            try:
                yield device_graph
            finally:
                device_graph.capture_end()

    setattr(module, graph_cls.api_name, make_graph)
    module.graph = graph
    module.graph_pool_handle = lambda: (id(rt), 1)


# ------------------------------------------------------------------------- memory
class MemoryCounters:
    """allocated / reserved / peak bytes, driven by the runtime's allocation calls."""

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.peak = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated = max(0, self.allocated - nbytes)

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def stats(self) -> dict[str, int]:
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.current": self.reserved,
        }


class AllocationTracker(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts, in :class:`MemoryCounters`, every new storage an op creates while it is active.

    Emulated device tensors are host tensors, so the emulated "device memory" is the set of
    storages created under the emulation: each is counted once, when it first appears as an
    op output, and released by a finalizer when it is freed. Views and in-place results reuse
    an input's storage and are not counted again.
    """

    def __init__(self, counters: MemoryCounters):
        super().__init__()
        self._counters = counters
        self._live: dict[int, int] = {}

    def _release(self, key: int) -> None:
        nbytes = self._live.pop(key, None)
        if nbytes is not None:
            self._counters.free(nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            if t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if not key or key in self._live:
                continue
            self._live[key] = storage.nbytes()
            self._counters.allocate(storage.nbytes())
            weakref.finalize(storage, self._release, key)
        return out


class PinnedHost:
    """A runtime's page-locked host allocator, emulated: pinning returns a tracked copy."""

    def __init__(self, runtime: EmulatedRuntime):
        self._rt = runtime
        self._pinned: dict[int, weakref.ref] = {}

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":
            raise RuntimeError(f"cannot pin '{tensor.device}' memory: only dense CPU tensors can be pinned")
        self._rt.record("pin_memory", tensor.numel() * tensor.element_size())
        out = tensor.clone(memory_format=torch.contiguous_format)
        self._pinned[out.untyped_storage().data_ptr()] = weakref.ref(out.untyped_storage())
        return out

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        ref = self._pinned.get(tensor.untyped_storage().data_ptr()) if tensor.device.type == "cpu" else None
        return ref is not None and ref() is not None

    def install(self, patcher: Patcher, device_type: str) -> None:
        """Route ``Tensor.pin_memory()`` / ``is_pinned()`` (no device, or ``device_type``) here.

        With the vendor extension loaded, the machine's accelerator *is* that device, so a
        plain ``pin_memory()`` pins for it.
        """
        real_pin, real_is_pinned = torch.Tensor.pin_memory, torch.Tensor.is_pinned

        def ours(args, kwargs) -> bool:
            dev = kwargs.get("device", args[0] if args else None)
            return dev is None or str(dev).split(":")[0] == device_type

        def pin_memory(tensor, *args, **kwargs):
            return self.pin(tensor) if ours(args, kwargs) else real_pin(tensor, *args, **kwargs)

        def is_pinned(tensor, *args, **kwargs):
            return self.is_pinned(tensor) if ours(args, kwargs) else real_is_pinned(tensor, *args, **kwargs)

        patcher.setattr(torch.Tensor, "pin_memory", pin_memory)
        patcher.setattr(torch.Tensor, "is_pinned", is_pinned)


# ------------------------------------------------------------------------ patcher
class _FailingImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the package (it is "installed") but fails while executing it, like a missing .so."""

    def __init__(self, name: str, error: BaseException):
        self.name = name
        self.error = error

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.error


class _LazyModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, name: str, on_import: Callable[[types.ModuleType], None]):
        self.name = name
        self.on_import = on_import

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=False)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        setattr(module, EMULATED_MARKER, True)
        self.on_import(module)


class Patcher:
    """Installs fake modules/attributes/env vars and undoes every change, in reverse, on exit.

    On enter and on exit it resets polyaccel's selection (so discovery and probing happen
    afresh against the installed runtime) and clears torch's device-module cache.
    """

    def __init__(self, reset_selection: bool = True):
        self._undo: list[Callable[[], None]] = []
        self._reset_selection = reset_selection

    # -- modules
    def set_module(self, name: str, module: Any) -> Any:
        old = sys.modules.get(name, _MISSING)
        sys.modules[name] = module
        self._undo.append(lambda: self._restore_module(name, old))
        return module

    def remove_module(self, name: str) -> None:
        """Hide an imported module (and its submodules) until exit."""
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            old = sys.modules.pop(key)
            self._undo.append(lambda key=key, old=old: sys.modules.__setitem__(key, old))

    def fail_import(self, name: str, error: BaseException) -> None:
        """Make ``import name`` raise ``error`` (e.g. a vendor library missing) until exit."""
        self.remove_module(name)
        finder = _FailingImport(name, error)
        sys.meta_path.insert(0, finder)
        self._undo.append(lambda: sys.meta_path.remove(finder))

    def lazy_module(self, name: str, on_import: Callable[[types.ModuleType], None]) -> None:
        """Make ``name`` importable; ``on_import(module)`` runs when (and only when) it is imported.

        For extensions whose import has side effects (registering kernels, patching torch):
        the effect appears at import time, as with the real package.
        """
        self.remove_module(name)
        finder = _LazyModule(name, on_import)
        sys.meta_path.insert(0, finder)

        def undo() -> None:
            sys.meta_path.remove(finder)
            for key in [k for k in sys.modules if k == name]:
                del sys.modules[key]

        self._undo.append(undo)

    @staticmethod
    def _restore_module(name: str, old: Any) -> None:
        if old is _MISSING:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = old

    # -- attributes
    def setattr(self, obj: Any, name: str, value: Any) -> Any:
        old = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name, _MISSING)
        setattr(obj, name, value)

        def undo() -> None:
            if old is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
            else:
                setattr(obj, name, old)

        self._undo.append(undo)
        return value

    def delattr(self, obj: Any, name: str) -> None:
        if name not in getattr(obj, "__dict__", {}):
            return
        old = obj.__dict__[name]
        delattr(obj, name)
        self._undo.append(lambda: setattr(obj, name, old))

    # -- environment
    def setenv(self, name: str, value: str | None) -> None:
        old = os.environ.get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

        def undo() -> None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old

        self._undo.append(undo)

    def on_exit(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    # -- lifecycle
    def _refresh(self) -> None:
        torch.get_device_module.cache_clear()
        if self._reset_selection:
            from polyaccel import selection

            selection.reset()

    def restore(self) -> None:
        errors = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as exc:  # keep undoing the rest; report afterwards
                errors.append(exc)
        self._refresh()
        if errors:
            raise RuntimeError(f"emulation teardown failed: {errors!r}")

    def __enter__(self) -> Patcher:
        self._refresh()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


# ------------------------------------------------------------------------ runtime
class EmulatedRuntime:
    """Base of every emulated vendor runtime.

    Subclasses set ``name`` (the plugin name), ``FAULTS`` (switch name -> what it does)
    and implement :meth:`install`. ``calls`` records every runtime call; ``queue`` is the
    default stream's asynchronous work; ``label`` is :data:`EMULATED`.
    """

    name: str = ""
    FAULTS: Mapping[str, str] = {}
    label = EMULATED

    def __init__(self, polls_to_complete: int = 1, **faults: Any):
        self.faults = Faults(self.name, self.FAULTS, faults)
        self.calls = CallLog()
        self.polls_to_complete = polls_to_complete
        self.memory = MemoryCounters()
        self._default_stream: EmulatedStream | None = None
        self._current_stream: EmulatedStream | None = None
        self.active = False

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

    def install(self, patcher: Patcher) -> None:
        """Install the stand-in through ``patcher`` (fake modules, torch attributes)."""
        raise NotImplementedError(f"{type(self).__name__} must implement install(patcher)")

    @contextlib.contextmanager
    def activate(self) -> Iterator[EmulatedRuntime]:
        with Patcher() as patcher:
            self.install(patcher)
            patcher._refresh()
            self.active = True
            try:
                yield self
            finally:
                self.active = False

    def __repr__(self) -> str:
        return f"<emulated {self.name} runtime, faults={self.faults.active()}, {len(self.calls)} calls>"


def device_index(device: Any) -> int | None:
    """The index in ``3``, ``"npu:3"``, ``torch.device("npu", 3)``; None for "current"."""
    if device is None or isinstance(device, int):
        return device
    if isinstance(device, str):
        return int(device.split(":")[1]) if ":" in device else None
    return getattr(device, "index", None)


def device_module_functions(rt: EmulatedRuntime, *, device_name: str, invalid_device: str,
                            total_memory: int = 64 * 2**30) -> dict[str, Callable[..., Any]]:
    """The ``torch.<device>`` functions every emulated runtime shares, bound to ``rt``.

    ``rt`` needs ``device_count`` and ``current``; ``invalid_device`` is the runtime's own
    message for a bad ordinal (``{device}`` and ``{count}`` are filled in). The emulated device
    *is* the host, so the device RNG functions act on torch's default (CPU) generator.
    """

    def get_device_name(device=None) -> str:
        return device_name

    functions = [get_device_name, *_device_functions(rt, invalid_device), *_rng_functions(rt),
                 *_memory_functions(rt, total_memory), *_stream_functions(rt)]
    return {fn.__name__: fn for fn in functions}


def _device_functions(rt: EmulatedRuntime, invalid_device: str) -> list[Callable[..., Any]]:
    def is_available() -> bool:
        rt.record("is_available")
        return rt.device_count > 0

    def device_count() -> int:
        return rt.device_count

    def current_device() -> int:
        return rt.current

    def set_device(device) -> None:
        idx = device_index(device)
        if idx is None or not 0 <= idx < rt.device_count:
            raise RuntimeError(invalid_device.format(device=repr(device), count=rt.device_count))
        rt.record("set_device", idx)
        rt.current = idx

    def synchronize(device=None) -> None:
        rt.record("synchronize", device_index(device))
        rt.synchronize_all()

    return [is_available, device_count, current_device, set_device, synchronize]


def _rng_functions(rt: EmulatedRuntime) -> list[Callable[..., Any]]:
    def manual_seed(seed: int) -> None:
        rt.record("manual_seed", int(seed))
        torch.manual_seed(int(seed))

    def manual_seed_all(seed: int) -> None:
        rt.record("manual_seed_all", int(seed))
        torch.manual_seed(int(seed))

    def initial_seed() -> int:
        return torch.initial_seed()

    def get_rng_state(device=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(new_state)

    return [manual_seed, manual_seed_all, initial_seed, get_rng_state, set_rng_state]


def _memory_functions(rt: EmulatedRuntime, total_memory: int) -> list[Callable[..., Any]]:
    def memory_allocated(device=None) -> int:
        return rt.memory.allocated

    def max_memory_allocated(device=None) -> int:
        return rt.memory.peak

    def memory_reserved(device=None) -> int:
        return rt.memory.reserved

    def reset_peak_memory_stats(device=None) -> None:
        rt.memory.reset_peak()

    def memory_stats(device=None) -> dict:
        return rt.memory.stats()

    def empty_cache() -> None:
        rt.record("empty_cache")
        rt.memory.empty_cache()

    def mem_get_info(device=None) -> tuple[int, int]:
        return total_memory - rt.memory.reserved, total_memory

    return [memory_allocated, max_memory_allocated, memory_reserved, reset_peak_memory_stats, memory_stats,
            empty_cache, mem_get_info]


def _stream_functions(rt: EmulatedRuntime) -> list[Callable[..., Any]]:
    def Stream(device=None, priority: int = 0, **kwargs) -> EmulatedStream:  # noqa: N802
        return EmulatedStream(rt, device, priority)

    def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):  # noqa: N802
        return EmulatedEvent(rt, enable_timing, blocking, interprocess)

    def current_stream(device=None) -> EmulatedStream:
        return rt.current_stream()

    def default_stream(device=None) -> EmulatedStream:
        return rt.default_stream()

    def stream(s):
        return rt.use_stream(s)

    return [Stream, Event, current_stream, default_stream, stream]


def emulation_fixture(emulate: Callable[..., contextlib.AbstractContextManager], **faults: Any):
    """Build a pytest fixture that runs a test inside ``emulate(**faults)`` and yields the runtime."""
    import pytest

    @pytest.fixture
    def _fixture():
        with emulate(**faults) as runtime:
            yield runtime

    return _fixture
