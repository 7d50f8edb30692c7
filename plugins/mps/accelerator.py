"""Apple GPUs through ``torch.mps``: one device, unified memory, no streams and no device graphs.

Unified memory: CPU and GPU share physical memory, so there is nothing to page-lock and
nothing to register for DMA. ``pin_memory(t)`` returns ``t`` itself (no copy) and
``is_pinned`` is True for every host tensor; ``register_host_memory`` raises
:class:`polyaccel.Unsupported`, since torch offers no way to hand an existing host buffer to
Metal without a copy and pretending to register it would be a silent no-op.
"""

from __future__ import annotations

import platform
from typing import Any

import torch
from polyaccel.accelerator import Accelerator, ProbeResult
from polyaccel.errors import PolyaccelError, Unsupported

_EMULATED_MARKER = "__polyaccel_emulated__"
_UNIFIED = "unified memory: host tensors are already visible to the GPU; use pin_memory(), which returns the tensor"


class MpsAccelerator(Accelerator):
    name = "mps"
    device_type = "mps"
    priority = 100
    communication_backend = "gloo"

    def __init__(self) -> None:
        super().__init__()
        self._caps: frozenset[str] | None = None

    # ------------------------------------------------------------- identity
    def is_emulated(self) -> bool:
        return getattr(getattr(torch, "mps", None), _EMULATED_MARKER, False) is True

    def probe(self) -> ProbeResult:
        backend = getattr(torch.backends, "mps", None)
        emulated = self.is_emulated()
        if backend is None or getattr(torch, "mps", None) is None:
            return ProbeResult(False, f"torch {torch.__version__} has no MPS support (torch.backends.mps missing)")
        if not backend.is_built():
            return ProbeResult(False, f"torch {torch.__version__} is built without MPS; MPS needs a macOS build of "
                                      f"torch on Apple silicon (this is {platform.system()} {platform.machine()})",
                               emulated=emulated)
        if not backend.is_available():
            return ProbeResult(False, "torch.backends.mps.is_available() is False: MPS needs macOS 12.3+ on "
                                      "Apple silicon (or an AMD GPU) and a torch built with MPS", emulated=emulated)
        return ProbeResult(True, "", int(torch.mps.device_count()), emulated)

    def capabilities(self) -> frozenset[str]:
        if self._caps is None:
            caps = {"events", "rng", "pinned", "fp16"}
            if torch.backends.mps.is_macos_or_newer(14, 0):
                caps.add("bf16")
            self._caps = frozenset(caps)
        return self._caps

    # ---------------------------------------------------------------- device
    def device(self, index: int | None = None) -> torch.device:
        """Under emulation tensors live on the host (the stand-in runtime keeps them on the CPU)."""
        if self.is_emulated():
            return torch.device("cpu")
        return torch.device("mps", 0 if index is None else index)

    def device_count(self) -> int:
        return int(torch.mps.device_count())

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        if index != 0:
            raise PolyaccelError(f"mps has a single device (index 0); cannot select device {index}")

    def synchronize(self, index: int | None = None) -> None:
        torch.mps.synchronize()

    def is_synchronized_device(self) -> bool:
        """All MPS work runs in submission order on one command queue."""
        return True

    def resolves_data_dependency(self) -> bool:
        return True

    # ------------------------------------------------------------------- RNG
    def manual_seed(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def initial_seed(self) -> int:
        return int(torch.mps._get_default_mps_generator().initial_seed())

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        return torch.mps.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        torch.mps.set_rng_state(state)

    # ---------------------------------------------------------------- memory
    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    def memory_report(self) -> dict[str, int]:
        """What torch.mps counts (it keeps no peak, so 'memory_stats' is not claimed)."""
        return {"current_allocated": int(torch.mps.current_allocated_memory()),
                "driver_allocated": int(torch.mps.driver_allocated_memory()),
                "recommended_max": int(torch.mps.recommended_max_memory())}

    # --------------------------------------------------------- pinned memory
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Unified memory: the host tensor is returned as it is, without a copy."""
        if tensor.device.type != "cpu":
            raise PolyaccelError(f"pin_memory needs a host (cpu) tensor, got one on {tensor.device}")
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Every host tensor counts as pinned on unified memory; device tensors are not host memory."""
        return tensor.device.type == "cpu"

    def empty_pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def register_host_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        raise Unsupported(self.name, "host_register", _UNIFIED)

    def unregister_host_memory(self, tensor: torch.Tensor) -> bool:
        raise Unsupported(self.name, "host_register", _UNIFIED)

    # ---------------------------------------------------------------- graphs
    def _no_graphs(self):
        raise Unsupported(self.name, "graphs", "MPS has no device graphs; use eager execution (or torch.compile)")

    def create_graph(self):
        self._no_graphs()

    def capture_to_graph(self, graph, pool=None, stream=None):
        self._no_graphs()

    def replay_graph(self, graph) -> None:
        self._no_graphs()

    def report(self) -> dict[str, Any]:
        return {"unified_memory": "pin_memory returns the tensor; host registration is unsupported",
                "memory": self.memory_report(),
                "fused_adam_kernel": "Metal (torch.mps.compile_shader)" if hasattr(torch.mps, "compile_shader")
                else "torch fused Adam (this torch has no torch.mps.compile_shader)"}
