"""Apple GPUs through ``torch.mps``: one device, unified memory, no streams and no device graphs.

Unified memory, as torch implements it for MPS: ``pin_memory(t)`` copies ``t`` once into a
buffer of MPS's *shared* allocator (an ``MTLBuffer`` in shared storage mode, which CPU and
GPU both address, so later host<->device transfers need no staging copy); ``is_pinned`` is
True exactly for such buffers. Registering an *existing* host buffer raises
:class:`polyaccel.Unsupported`: torch offers no way to wrap an arbitrary host allocation
as an ``MTLBuffer`` without a copy, and pretending to register it would be a silent no-op.
"""

from __future__ import annotations

import platform
from typing import Any

import torch
from polyaccel.accelerator import Accelerator, ProbeResult
from polyaccel.comm import CommHooks
from polyaccel.errors import PolyaccelError, Unsupported

_UNIFIED = ("torch cannot hand an existing host buffer to Metal without a copy; use pin_memory() (one copy into "
            "MPS's shared, GPU-visible allocator) or empty_pinned()")


class MpsAccelerator(Accelerator):
    name = "mps"
    device_type = "mps"
    priority = 100
    communication_backend = "gloo"

    def __init__(self) -> None:
        super().__init__()
        self._caps: frozenset[str] | None = None

    # ------------------------------------------------------------- identity
    def probe(self) -> ProbeResult:
        backend = getattr(torch.backends, "mps", None)
        if backend is None or getattr(torch, "mps", None) is None:
            return ProbeResult(False, f"torch {torch.__version__} has no MPS support (torch.backends.mps missing)")
        if not backend.is_built():
            return ProbeResult(False, f"torch {torch.__version__} is built without MPS; MPS needs a macOS build of "
                                      f"torch on Apple silicon (this is {platform.system()} {platform.machine()})")
        if not backend.is_available():
            return ProbeResult(False, "torch.backends.mps.is_available() is False: MPS needs macOS 12.3+ on "
                                      "Apple silicon (or an AMD GPU) and a torch built with MPS")
        return ProbeResult(True, "", int(torch.mps.device_count()))

    def capabilities(self) -> frozenset[str]:
        if self._caps is None:
            caps = {"events", "rng", "pinned", "fp16"}
            newer = getattr(torch.backends.mps, "is_macos_or_newer", None)
            if newer is not None and newer(14, 0):
                caps.add("bf16")
            self._caps = frozenset(caps)
        return self._caps

    # ---------------------------------------------------------------- device
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
    # torch.mps has manual_seed (the base's default) but no manual_seed_all or initial_seed,
    # and its get/set_rng_state take no device index
    def manual_seed_all(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def initial_seed(self) -> int:
        return int(torch.mps._get_default_mps_generator().initial_seed())

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        return torch.mps.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        torch.mps.set_rng_state(state)

    # ---------------------------------------------------------------- memory
    def memory_report(self) -> dict[str, int]:
        """What torch.mps counts (it keeps no peak, so 'memory_stats' is not claimed)."""
        return {"current_allocated": int(torch.mps.current_allocated_memory()),
                "driver_allocated": int(torch.mps.driver_allocated_memory()),
                "recommended_max": int(torch.mps.recommended_max_memory())}

    # --------------------------------------------------------- pinned memory
    def register_host_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        raise Unsupported(self.name, "host_register", _UNIFIED)

    def unregister_host_memory(self, tensor: torch.Tensor) -> bool:
        raise Unsupported(self.name, "host_register", _UNIFIED)

    def comm_hooks(self):
        """gloo cannot read MPS tensors: every tensor goes through host staging (async copy back in wait())."""
        return CommHooks(backend="gloo", supports_device_tensors=False)

    def report_facts(self) -> dict[str, Any] | None:
        if not self.probe().available:
            return None
        return {"unified_memory": "pin_memory copies into MPS's shared allocator; host registration is unsupported",
                "memory": self.memory_report(),
                "fused_adam_kernel": "Metal (torch.mps.compile_shader)" if hasattr(torch.mps, "compile_shader")
                else "torch fused Adam (this torch has no torch.mps.compile_shader)"}
