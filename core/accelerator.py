"""The accelerator contract: one class per backend, each method a hook with a default.

A plugin's accelerator derives from :class:`Accelerator` and overrides only what its hardware
does differently. The defaults are device-generic and never ask which device they serve: the
device module (``torch.get_device_module(device_type)``) for what it has, ``torch.accelerator``
(and ``torch.Stream`` / ``torch.Event``) where torch's accelerator is this device type; the
plumbing is :mod:`polyaccel.device_generic`. Pinned and registered host memory is declared in
:class:`polyaccel.host_registration.HostMemory`, a base of this class. A backend whose tensors
are host tensors derives from :class:`polyaccel.host_accelerator.HostAccelerator`, which
carries the host's answers.

Growing this class (docs/design.md, "Versioning"): a new method always gets a default, never
an abstract one, and optional features are capabilities (:meth:`Accelerator.capabilities`).
An unclaimed feature raises :class:`polyaccel.Unsupported`; nothing here is a silent no-op.
docs/plugin-authoring.md, section 3, walks through every method.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from . import device_generic as generic
from .comm_hooks import CommHooks
from .errors import PolyaccelError, Unsupported
from .host_registration import HostMemory, HostRegistrations
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


class Accelerator(HostMemory):
    """Base class of every backend's accelerator.

    Identity is class-level so that the registry can read it without instantiating
    (instantiation must stay cheap anyway: it must not initialise a device runtime).
    """

    #: plugin name, unique among installed plugins ("cuda", "rocm", "cpu", ...)
    name: ClassVar[str] = ""
    #: torch's device type for tensors of this backend ("cuda" for rocm too; a class whose tensors are
    #: host tensors derives from HostAccelerator, and discovery gives a 1.x one left at "cpu" its answers)
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

    def __init__(self) -> None:
        self._host_memory = HostRegistrations(self.name)

    # ------------------------------------------------------------- identity and claims
    def probe(self) -> ProbeResult:
        """Ask the runtime whether this backend can be used here, and why not. Must be cheap."""
        mod = self._device_module(required=False)
        if mod is None or not hasattr(mod, "is_available"):
            return ProbeResult(False, f"torch has no '{self.device_type}' device module")
        if not mod.is_available():
            return ProbeResult(False, f"torch.{self.device_type}.is_available() is False")
        return ProbeResult(True, "", int(mod.device_count()))

    def capabilities(self) -> frozenset[str]:
        """The features this plugin claims (:data:`KNOWN_CAPABILITIES`); each passes its conformance test."""
        return frozenset()

    def has(self, capability: str) -> bool:
        return capability in self.capabilities()

    def require(self, capability: str, hint: str = "") -> None:
        """Raise :class:`Unsupported` unless ``capability`` is claimed: every guarded default starts here."""
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

    def comm_hooks(self):
        """How ``polyaccel.comm`` talks over this backend (a :class:`polyaccel.comm.CommHooks`).

        Default: ``communication_backend`` (given the local device where ``comm_binds_device``),
        device tensors handed over as they are. Another plugin may override the answer
        (``polyaccel_comm_hooks``).
        """
        return CommHooks.defaults_for(self)

    def report_facts(self) -> dict[str, Any] | None:
        """Facts for ``polyaccel report`` (runtime versions, devices), or None. Asked of every probed
        accelerator, available or not, so a plugin can say why its runtime is unusable."""
        return None

    # ------------------------------------------------- where the defaults find torch's functions
    def _device_module(self, required: bool = True):
        try:
            return torch.get_device_module(self.device_type)
        except Exception:
            mod = getattr(torch, self.device_type, None)
            if mod is None and required:
                raise Unsupported(self.name, f"torch.{self.device_type}") from None
            return mod

    def _torch_accelerator_serves(self) -> bool:
        """Whether ``torch.accelerator`` (and ``torch.Stream``/``torch.Event``) act on this device type."""
        current = torch.accelerator.current_accelerator()
        return current is not None and current.type == self.device_type

    def _device_function(self, name: str, generic_name: str | None = None, required: bool = True):
        """The device module's ``name``, else ``torch.accelerator.<generic_name or name>``."""
        return generic.device_function(self, name, generic_name, required)

    # ------------------------------------------------------------------ device
    def device(self, index: int | None = None) -> torch.device:
        """The torch device of this backend's tensors (``index`` None: the current device)."""
        return torch.device(self.device_type, self.current_device() if index is None else index)

    def device_count(self) -> int:
        """Devices this process can use."""
        return int(self._device_function("device_count")())

    def current_device(self) -> int:
        """The current device index (from a module's int, device string or ``torch.device`` answer)."""
        return generic.device_index(self._device_function("current_device", "current_device_index")())

    def set_device(self, index: int) -> None:
        self._device_function("set_device", "set_device_index")(index)

    def synchronize(self, index: int | None = None) -> None:
        """Wait for the device's queued work."""
        self._device_function("synchronize")(index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device_type

    # --------------------------------------------------------- execution model (read by the engines)
    def is_synchronized_device(self) -> bool:
        """Device work runs in host order, so no side streams are needed (a device queues work: False)."""
        return False

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """The runtime orders cross-stream data dependencies by itself."""
        return False

    def handles_memory_backpressure(self) -> bool:
        """The allocator copes with memory pressure by itself."""
        return False

    # ------------------------------------------------------ streams and events ("streams", "events")
    def Stream(self, device=None, **kwargs):
        """A new stream (``priority=`` as a keyword) on ``device`` (index or device; None: current)."""
        self.require("streams")
        return generic.new_stream(self, device, **kwargs)

    def Event(self, **kwargs):
        """A new event; ``enable_timing=``, ``blocking=``, ``interprocess=`` as keywords."""
        self.require("events")
        return generic.new_event(self, **kwargs)

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
        return generic.stream_context(self, stream)

    # --------------------------------------------------------------------- RNG ("rng")
    def _rng_module(self):
        self.require("rng")
        return self._device_module()

    def manual_seed(self, seed: int) -> None:
        self._rng_module().manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._rng_module().manual_seed_all(seed)

    def initial_seed(self) -> int:
        return int(self._rng_module().initial_seed())

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        mod = self._rng_module()
        return mod.get_rng_state() if index is None else mod.get_rng_state(index)

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        mod = self._rng_module()
        if index is None:
            mod.set_rng_state(state)
        else:
            mod.set_rng_state(state, index)

    # ------------------------------------------------------------------ memory ("memory_stats")
    def _memory_call(self, fn: str, index: int | None, generic_name: str | None = None):
        self.require("memory_stats")
        return self._device_function(fn, generic_name)(index)

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
        """Release cached device memory; a runtime that keeps no cache has nothing to release."""
        release = self._device_function("empty_cache", required=False)
        if release is not None:
            release()

    def total_memory(self, index: int | None = None) -> int:
        return int(self._memory_call("mem_get_info", index, "get_memory_info")[1])

    def available_memory(self, index: int | None = None) -> int:
        return int(self._memory_call("mem_get_info", index, "get_memory_info")[0])

    # ------------------------------------------------------------------ dtypes ("bf16", "fp16", ...)
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        caps = self.capabilities()
        extra = (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp64", torch.float64))
        return (torch.float32, *(dt for cap, dt in extra if cap in caps))

    def is_bf16_supported(self) -> bool:
        return "bf16" in self.capabilities()

    def is_fp16_supported(self) -> bool:
        return "fp16" in self.capabilities()

    def is_fp64_supported(self) -> bool:
        return "fp64" in self.capabilities()

    def fp8_dtypes(self) -> tuple[torch.dtype, ...]:
        """fp8 formats this device computes in natively (e4m3 first); override when claiming "fp8"."""
        return ()

    def is_triton_supported(self) -> bool:
        return "triton" in self.capabilities()

    def runtime_call_error(self, call: str, rc: int, detail: str = "", *, hint: str = "",
                           unregistering: bool = False) -> PolyaccelError:
        """The error for the runtime's ``call`` returning the nonzero ``rc``; ``detail``: its words for it.

        ``unregistering``: the pages stay registered and the buffer is kept alive; the message says so.
        """
        msg = f"{self.name}: {call} failed with {self.return_code_name} {rc}"
        if detail:
            msg += f" ({detail})"
        if unregistering:
            hint = "the buffer is kept alive (never freed) because the device may still access it"
        return PolyaccelError(f"{msg}; {hint}" if hint else msg)

    # ------------------------------------------------------------------ graphs ("graphs")
    # The device module's graph_class where the plugin names one; else torch.accelerator.Graph where
    # torch's accelerator is this device type; else Unsupported, never another backend's graph.
    def _require_graphs(self) -> None:
        generic.require_graphs(self)

    def create_graph(self):
        self._require_graphs()
        return generic.new_graph(self)

    def capture_to_graph(self, graph, pool=None, stream=None):
        """Context manager capturing into ``graph`` on ``stream`` (by default a side stream: runtimes
        refuse to capture the default stream); ``pool`` shares another graph's memory pool."""
        self._require_graphs()
        return generic.capture(self, graph, pool, stream)

    def replay_graph(self, graph) -> None:
        """Re-run the captured work on the current contents of its inputs."""
        self.require("graphs", "use eager execution; this backend has no device graphs")
        graph.replay()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} device_type={self.device_type!r}>"
