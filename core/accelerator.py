"""The accelerator contract: one class per backend, defaults in the base.

Every plugin's accelerator derives from :class:`Accelerator` and overrides only what
its hardware does differently. Defaults delegate to torch's device-generic APIs: the
device module (``torch.get_device_module(device_type)``) for what it has, and, where torch's
accelerator is this device type, ``torch.accelerator`` (device, memory, graphs) and
``torch.Stream``/``torch.Event`` for what the module lacks. A backend that torch already
knows needs very little code.

A backend whose tensors live in host memory (``device_type = "cpu"``: a plugin that presents
the host, or a runtime reached through host tensors) gets working defaults too: one device
per process, program-order execution, and torch's default generator for RNG. Such a plugin
needs to define only its identity and :meth:`Accelerator.probe`.

Rules for growing this class (see docs/design.md, "The contract is versioned"): new methods
always get a default implementation — never add an abstract method — and optional
features are declared through :meth:`Accelerator.capabilities`. A feature that is not
claimed raises :class:`polyaccel.Unsupported`; nothing here is a silent no-op.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .comm_hooks import CommHooks
from .errors import InvalidArgument, PolyaccelError, Unsupported
from .version import API_VERSION

#: Capability names the core knows about. Plugins may claim extra, free-form names.
KNOWN_CAPABILITIES = (
    "streams",  # Stream/Event objects with real ordering semantics
    "events",
    "graphs",  # create/capture/replay of device graphs
    "host_register",  # register an existing host buffer for DMA without copying
    "pinned",  # page-locked host allocations through pin_memory()
    "async_p2p",  # isend/irecv that never block on device tensors
    "memory_stats",  # allocated/reserved/peak counters
    "rng",  # seed + get/set generator state
    "fp64",
    "bf16",
    "fp16",
    "fp8",
    "triton",
)


@dataclass(frozen=True)
class ProbeResult:
    """What :meth:`Accelerator.probe` found: usable or not, and why, in words a user can act on."""

    available: bool
    reason: str = ""
    device_count: int = 0
    emulated: bool = False
    details: dict[str, Any] = field(default_factory=dict)


class _HostRegistration:
    __slots__ = ("ptr", "nbytes", "count", "tensor", "leaked")

    def __init__(self, ptr: int, nbytes: int, tensor: torch.Tensor):
        self.ptr = ptr
        self.nbytes = nbytes
        self.count = 1
        self.tensor = tensor
        self.leaked = False


class Accelerator:
    """Base class of every backend's accelerator.

    Identity is class-level so that the registry can read it without instantiating
    (instantiation must stay cheap anyway: it must not initialise a device runtime).
    """

    #: plugin name, unique among installed plugins ("cuda", "rocm", "cpu", ...)
    name: ClassVar[str] = ""
    #: torch's device type for tensors of this backend ("cuda" for rocm too)
    device_type: ClassVar[str] = "cpu"
    #: contract version the plugin was written against; major must match polyaccel's
    api_version: ClassVar[str] = API_VERSION
    #: auto-selection order; device plugins above cpu (0). Negative: only by name.
    priority: ClassVar[int] = 0
    #: torch.distributed backend name
    communication_backend: ClassVar[str] = "gloo"
    #: the backend binds a communicator to one device (NCCL, HCCL): ``init_process_group`` gets the
    #: local device as ``device_id`` (the default :meth:`comm_hooks`' ``pass_device_id``)
    comm_binds_device: ClassVar[bool] = False
    #: what the device runtime calls its nonzero return codes, in messages ("error", "ACL error", ...)
    return_code_name: ClassVar[str] = "error"
    #: the device module's graph class ("CUDAGraph", "NPUGraph", ...), captured through the module's
    #: ``graph(graph, pool=, stream=)`` context manager; empty: torch.accelerator.Graph where torch serves
    graph_class: ClassVar[str] = ""

    # ----------------------------------------------------------------- identity
    def __init__(self) -> None:
        self._host_regs: dict[int, _HostRegistration] = {}
        self._host_lock = threading.Lock()

    def probe(self) -> ProbeResult:
        """Ask the runtime whether this backend can be used here. Must be cheap."""
        mod = self._device_module(required=False)
        if mod is None or not hasattr(mod, "is_available"):
            return ProbeResult(False, f"torch has no '{self.device_type}' device module")
        if not mod.is_available():
            return ProbeResult(False, f"torch.{self.device_type}.is_available() is False")
        return ProbeResult(True, "", int(mod.device_count()))

    def capabilities(self) -> frozenset[str]:
        """The features this plugin claims; each must pass its conformance test."""
        return frozenset()

    def has(self, capability: str) -> bool:
        return capability in self.capabilities()

    def require(self, capability: str, hint: str = "") -> None:
        if capability not in self.capabilities():
            raise Unsupported(self.name, capability, hint)

    def is_emulated(self) -> bool:
        """True while an emulated runtime stands in for this accelerator's (``polyaccel.testing.emulation``
        makes it so, together with host placement; production classes never override it)."""
        return False

    def describe(self) -> str:
        return f"{self.name} (torch device type {self.device_type!r})"

    def visible_devices_envs(self) -> list[str]:
        """Environment variables a launcher sets to choose which devices a process sees (none by default)."""
        return []

    # ------------------------------------------------------- comm and report
    def comm_hooks(self):
        """How ``polyaccel.comm`` talks over this backend (a :class:`polyaccel.comm.CommHooks`).

        Default: ``communication_backend`` (given the local device where ``comm_binds_device``),
        device tensors handed to it as they are, nothing staged or emulated. Another plugin may
        override the answer (``polyaccel_comm_hooks``).
        """
        return CommHooks.defaults_for(self)

    def report_facts(self) -> dict[str, Any] | None:
        """Facts about this accelerator for ``polyaccel report`` (runtime versions, devices), or None.

        Asked of every accelerator that was probed, available or not, so a plugin can say why
        its runtime is unusable; shown under the plugin's name.
        """
        return None

    def _device_module(self, required: bool = True):
        try:
            return torch.get_device_module(self.device_type)
        except Exception:
            mod = getattr(torch, self.device_type, None)
            if mod is None and required:
                raise Unsupported(self.name, f"torch.{self.device_type}") from None
            return mod

    def _torch_accelerator_serves(self) -> bool:
        """Whether ``torch.accelerator`` (and ``torch.Stream``/``torch.Event``) act on this device type.

        torch drives one accelerator per process, the one its build was compiled for; its
        device-generic APIs serve a backend only when that accelerator is this device type.
        """
        current = torch.accelerator.current_accelerator()
        return current is not None and current.type == self.device_type

    def _device_function(self, name: str, generic: str | None = None, required: bool = True):
        """The device module's ``name``, else ``torch.accelerator.<generic or name>`` where it serves us.

        The module comes first: its functions are the ones its streams, events and emulated
        stand-ins agree with. Neither having the function raises :class:`Unsupported`
        (returns None when not ``required``).
        """
        fn = getattr(self._device_module(required=False), name, None)
        if fn is None and self._torch_accelerator_serves():
            fn = getattr(torch.accelerator, generic or name, None)
        if fn is None and required:
            raise self._missing(name, f"torch.accelerator.{generic or name}")
        return fn

    def _missing(self, name: str, generic: str) -> Unsupported:
        return Unsupported(self.name, f"torch.{self.device_type}.{name}",
                           f"torch {torch.__version__} has neither it nor {generic} for device type "
                           f"{self.device_type!r}; the plugin must implement it")

    # ------------------------------------------------------------------- device
    def device(self, index: int | None = None) -> torch.device:
        """The torch device of this backend's tensors."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        if index is None:
            index = self.current_device()
        return torch.device(self.device_type, index)

    def device_count(self) -> int:
        """Devices this process can use; the host is one device per process."""
        if self.device_type == "cpu":
            return 1
        return int(self._device_function("device_count")())

    def current_device(self) -> int:
        """The current device index (0 for the host).

        torch's device modules answer an int, a device string (``torch.cpu`` says ``"cpu"``)
        or a ``torch.device``; all of them are turned into an index here.
        """
        if self.device_type == "cpu":
            return 0
        return _device_index(self._device_function("current_device", "current_device_index")())

    def set_device(self, index: int) -> None:
        """Make ``index`` current. The host accepts 0, and this process's LOCAL_RANK (one device per rank)."""
        if self.device_type == "cpu":
            if index not in (0, int(os.environ.get("LOCAL_RANK", 0))):
                raise InvalidArgument(f"{self.name} has one host device per process; cannot select device {index}")
            return
        self._device_function("set_device", "set_device_index")(index)

    def synchronize(self, index: int | None = None) -> None:
        """Wait for the device's queued work; host work is complete when each call returns."""
        if self.device_type == "cpu":
            return
        self._device_function("synchronize")(index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device_type

    # ------------------------------------------------------ execution model
    def is_synchronized_device(self) -> bool:
        """Device work runs in host order; no side streams are needed (True for the host)."""
        return self.device_type == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """The runtime orders cross-stream data dependencies by itself (True for the host)."""
        return self.device_type == "cpu"

    def handles_memory_backpressure(self) -> bool:
        """The allocator copes with memory pressure by itself (True for the host)."""
        return self.device_type == "cpu"

    # ---------------------------------------------------------- streams/events
    # The device module's classes where it has them, torch.Stream/torch.Event where it has none:
    # torch.cuda.Stream compares unequal to a generic torch.Stream for the same queue, so the
    # streams of one backend must all come from one family.
    def Stream(self, device=None, **kwargs):
        """A new stream (``priority=`` as a keyword) on ``device`` (index or device; None: current)."""
        self.require("streams")
        cls = getattr(self._device_module(required=False), "Stream", None)
        if cls is not None:
            return cls(device, **kwargs)
        if not self._torch_accelerator_serves():
            raise self._missing("Stream", "torch.Stream")
        index = device if device is None or isinstance(device, int) else torch.device(device).index
        return torch.Stream(torch.device(self.device_type, index), **kwargs)

    def Event(self, **kwargs):
        """A new event; ``enable_timing=``, ``blocking=``, ``interprocess=`` as keywords."""
        self.require("events")
        cls = getattr(self._device_module(required=False), "Event", None)
        if cls is not None:
            return cls(**kwargs)
        if not self._torch_accelerator_serves():
            raise self._missing("Event", "torch.Event")
        return torch.Event(self.device_type, **kwargs)

    def current_stream(self, index: int | None = None):
        self.require("streams")
        return self._device_function("current_stream")(index)

    def default_stream(self, index: int | None = None):
        self.require("streams")
        return self._device_function("default_stream")(index)

    def stream(self, stream):
        """Context manager making ``stream`` current. ``None`` is an explicit no-op."""
        if stream is None:
            return contextlib.nullcontext()
        self.require("streams")
        switch = getattr(self._device_module(required=False), "stream", None)
        if switch is None and isinstance(stream, torch.Stream):
            return stream  # a torch.Stream is its own context manager
        return (switch or self._device_function("stream"))(stream)

    # --------------------------------------------------------------------- RNG
    # Guarded by "rng". The host's generator is torch's default one (torch.cpu has no RNG API).
    def manual_seed(self, seed: int) -> None:
        self.require("rng")
        if self.device_type == "cpu":
            torch.manual_seed(seed)
            return
        self._device_module().manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.require("rng")
        if self.device_type == "cpu":
            torch.manual_seed(seed)
            return
        self._device_module().manual_seed_all(seed)

    def initial_seed(self) -> int:
        self.require("rng")
        if self.device_type == "cpu":
            return int(torch.initial_seed())
        return int(self._device_module().initial_seed())

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        self.require("rng")
        if self.device_type == "cpu":
            return torch.get_rng_state()
        mod = self._device_module()
        return mod.get_rng_state() if index is None else mod.get_rng_state(index)

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        self.require("rng")
        if self.device_type == "cpu":
            torch.set_rng_state(state)
            return
        mod = self._device_module()
        if index is None:
            mod.set_rng_state(state)
        else:
            mod.set_rng_state(state, index)

    # ------------------------------------------------------------------ memory
    def _memory_call(self, fn: str, index: int | None, generic: str | None = None):
        self.require("memory_stats")
        return self._device_function(fn, generic)(index)

    def memory_allocated(self, index: int | None = None) -> int:
        return int(self._memory_call("memory_allocated", index))

    def max_memory_allocated(self, index: int | None = None) -> int:
        return int(self._memory_call("max_memory_allocated", index))

    def memory_reserved(self, index: int | None = None) -> int:
        return int(self._memory_call("memory_reserved", index))

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        self._memory_call("reset_peak_memory_stats", index)

    def memory_stats(self, index: int | None = None) -> dict[str, Any]:
        return dict(self._memory_call("memory_stats", index))

    def empty_cache(self) -> None:
        """Release cached device memory; a runtime that keeps no cache (the host) has nothing to release."""
        release = None if self.device_type == "cpu" else self._device_function("empty_cache", required=False)
        if release is not None:
            release()

    def total_memory(self, index: int | None = None) -> int:
        free, total = self._memory_call("mem_get_info", index, "get_memory_info")
        return int(total)

    def available_memory(self, index: int | None = None) -> int:
        free, total = self._memory_call("mem_get_info", index, "get_memory_info")
        return int(free)

    # ------------------------------------------------------------------ dtypes
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        caps = self.capabilities()
        dtypes = [torch.float32]
        for cap, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp64", torch.float64)):
            if cap in caps:
                dtypes.append(dt)
        return tuple(dtypes)

    def is_bf16_supported(self) -> bool:
        return "bf16" in self.capabilities()

    def is_fp16_supported(self) -> bool:
        return "fp16" in self.capabilities()

    def is_fp64_supported(self) -> bool:
        return "fp64" in self.capabilities()

    def fp8_dtypes(self) -> tuple[torch.dtype, ...]:
        """fp8 formats this device computes in natively (e4m3 first)."""
        return ()

    # ------------------------------------------------------------ pinned memory
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return a page-locked copy of a host tensor (or the tensor if already pinned).

        Pins for torch's current accelerator, which is this backend's device once its runtime is
        loaded (torch serves one accelerator per process; the device argument is deprecated).
        """
        self.require("pinned")
        if tensor.device.type != "cpu":
            raise PolyaccelError(f"pin_memory needs a host (cpu) tensor, got one on {tensor.device}")
        if self.is_pinned(tensor):
            return tensor
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu":
            return False
        if tensor.data_ptr() in self._host_regs:
            return True
        return "pinned" in self.capabilities() and bool(tensor.is_pinned())

    def empty_pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Allocate a host buffer suitable for fast DMA: pinned, else registered, else plain."""
        buf = torch.empty(shape, dtype=dtype)
        if "pinned" in self.capabilities():
            return self.pin_memory(buf)
        return buf

    def pin_memory_alignment(self) -> int:
        """Byte alignment host registration needs; the registered range is rounded to it."""
        return 1

    def _host_register(self, ptr: int, nbytes: int) -> None:
        """Backend hook: register [ptr, ptr+nbytes) with the device runtime; raise on failure."""
        raise Unsupported(self.name, "host_register")

    def _host_unregister(self, ptr: int) -> None:
        """Backend hook: undo :meth:`_host_register`; raise on failure."""
        raise Unsupported(self.name, "host_register")

    def host_register_range(self, tensor: torch.Tensor) -> tuple[int, int]:
        """The (address, length) actually registered for ``tensor``: rounded to the alignment."""
        align = self.pin_memory_alignment()
        start = tensor.data_ptr()
        end = start + tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
        end = max(end, start + tensor.numel() * tensor.element_size())
        lo = start - start % align
        hi = -(-end // align) * align
        return lo, hi - lo

    def register_host_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Register an existing host buffer for DMA in place (no copy); refcounted.

        Registering the same buffer twice only counts; the runtime sees one
        registration until the last :meth:`unregister_host_memory`.
        """
        self.require("host_register")
        if tensor.device.type != "cpu":
            raise PolyaccelError(
                f"register_host_memory needs a host (cpu) tensor, got one on {tensor.device}"
            )
        if not tensor.is_contiguous():
            raise PolyaccelError("register_host_memory needs a contiguous tensor; call .contiguous() first")
        if tensor.numel() == 0:
            return tensor
        with self._host_lock:
            key = tensor.data_ptr()
            reg = self._host_regs.get(key)
            if reg is not None:
                reg.count += 1
                return tensor
            ptr, nbytes = self.host_register_range(tensor)
            self._host_register(ptr, nbytes)
            self._host_regs[key] = _HostRegistration(ptr, nbytes, tensor)
        return tensor

    def unregister_host_memory(self, tensor: torch.Tensor) -> bool:
        """Drop one reference; unregister on the last. Returns True when the runtime was told.

        If the runtime refuses to unregister, the buffer is kept alive forever (leaked)
        rather than freed: the device may still DMA into it.
        """
        self.require("host_register")
        if tensor.numel() == 0:
            return False
        with self._host_lock:
            reg = self._host_regs.get(tensor.data_ptr())
            if reg is None:
                raise PolyaccelError(
                    f"unregister_host_memory: buffer at {tensor.data_ptr():#x} was not registered "
                    f"with {self.name!r}"
                )
            reg.count -= 1
            if reg.count > 0:
                return False
            del self._host_regs[tensor.data_ptr()]
            try:
                self._host_unregister(reg.ptr)
            except Exception:
                reg.leaked = True
                _LEAKED_HOST_BUFFERS.append(reg)
                raise
        return True

    def runtime_call_error(self, call: str, rc: int, detail: str = "", *, hint: str = "",
                           unregistering: bool = False) -> PolyaccelError:
        """The error to raise when the device runtime's ``call`` returned the nonzero code ``rc``.

        ``detail`` is the runtime's own words for the code. A refused *unregistration* leaves the
        pages registered, so the device may still DMA into them: :meth:`unregister_host_memory`
        then keeps the buffer referenced forever (leaked, never freed), and the message says so.
        """
        msg = f"{self.name}: {call} failed with {self.return_code_name} {rc}"
        if detail:
            msg += f" ({detail})"
        if unregistering:
            hint = "the buffer is kept alive (never freed) because the device may still access it"
        return PolyaccelError(f"{msg}; {hint}" if hint else msg)

    def host_registrations(self) -> dict[int, int]:
        """Registered buffers: data pointer -> reference count."""
        return {k: r.count for k, r in self._host_regs.items()}

    # ------------------------------------------------------------------- graphs
    # The device module's graph_class where the plugin names one; else torch's device-generic
    # torch.accelerator.Graph, only where torch's accelerator is this device type; everywhere
    # else Unsupported, never a graph of another backend.
    def _require_graphs(self) -> None:
        if self.graph_class:
            self.require("graphs", f"torch.{self.device_type} has no {self.graph_class}; use eager execution")
            return
        self.require("graphs", "use eager execution; this backend has no device graphs")
        if not (hasattr(torch.accelerator, "Graph") and self._torch_accelerator_serves()):
            raise Unsupported(self.name, "graphs",
                              f"torch {torch.__version__} has no device-generic graph (torch.accelerator.Graph) for "
                              f"device type {self.device_type!r}; the plugin must name its graph_class or implement "
                              "create_graph, capture_to_graph and replay_graph")

    def create_graph(self):
        self._require_graphs()
        if self.graph_class:
            return getattr(self._device_module(), self.graph_class)()
        return torch.accelerator.Graph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        """Context manager capturing into ``graph`` on ``stream`` (by default a side stream: runtimes
        refuse to capture the default stream); ``pool`` shares another graph's memory pool."""
        self._require_graphs()
        if self.graph_class:
            return self._device_module().graph(graph, pool=pool, stream=stream)
        if pool is not None:
            graph.graph_pool = pool
        return _capturing(graph, self.stream(self.Stream() if stream is None else stream))

    def replay_graph(self, graph) -> None:
        self.require("graphs", "use eager execution; this backend has no device graphs")
        graph.replay()

    # --------------------------------------------------------------- triton
    def is_triton_supported(self) -> bool:
        return "triton" in self.capabilities()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} device_type={self.device_type!r}>"


@contextlib.contextmanager
def _capturing(graph, stream_context):
    with stream_context, graph:
        yield graph


def _device_index(current: Any) -> int:
    """An index from what a torch device module's ``current_device()`` returns (int, str or device)."""
    if isinstance(current, bool):
        raise TypeError(f"current_device() returned {current!r}, not a device index")
    if isinstance(current, int):
        return current
    if isinstance(current, (str, torch.device)):
        index = torch.device(current).index
        return 0 if index is None else int(index)
    return int(current)


#: Buffers whose unregistration failed: kept referenced so the memory is never freed.
_LEAKED_HOST_BUFFERS: list[_HostRegistration] = []
