"""AMD GPUs on torch's ROCm build: the cuda accelerator, with HIP's differences."""

from __future__ import annotations

import importlib

import torch
from polyaccel.plugins.cuda.accelerator import CudaAccelerator

#: gfx architectures (prefixes) whose fp8 is the FNUZ variant (MI300 family: gfx940/941/942)
FNUZ_FP8_ARCHS = ("gfx94",)
#: architectures with OCP fp8 (e4m3fn/e5m2): MI350 (gfx950) and RDNA4 (gfx12)
OCP_FP8_ARCHS = ("gfx95", "gfx12")
#: architectures with native bf16 arithmetic
BF16_ARCHS = ("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")
#: architectures Triton's AMD backend generates code for (CDNA2+, RDNA3+)
TRITON_ARCHS = ("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")


class RocmAccelerator(CudaAccelerator):
    name = "rocm"
    device_type = "cuda"  # torch's HIP build exposes AMD GPUs as device type "cuda"
    priority = 100
    communication_backend = "nccl"  # torch.distributed's name; the library behind it is RCCL
    collective_library = "rccl"
    runtime_library = "libamdhip64"
    last_error_symbol = "hipGetLastError"

    def _runtime_reason(self) -> str:
        if not getattr(torch.version, "hip", None):
            return "this torch is not a ROCm build (torch.version.hip is None)"
        return ""

    def probe(self):
        result = super().probe()
        if result.available:
            result.details["torch_hip"] = torch.version.hip
            result.details.pop("torch_cuda", None)
        elif not self._runtime_reason() and "is_available" in result.reason:
            return type(result)(False, "torch.cuda.is_available() is False: no usable AMD GPU or ROCm driver")
        return result

    def gcn_arch(self, index: int | None = None) -> str:
        """The device's gfx architecture, e.g. "gfx942" (feature suffixes such as ":sramecc+" dropped)."""
        props = torch.cuda.get_device_properties(self.current_device() if index is None else index)
        return str(getattr(props, "gcnArchName", "") or "").split(":")[0]

    def warp_size(self, index: int | None = None) -> int:
        """Wavefront size: 64 on CDNA (gfx9), 32 on RDNA (gfx10+)."""
        props = torch.cuda.get_device_properties(self.current_device() if index is None else index)
        size = getattr(props, "warp_size", None)
        if size:
            return int(size)
        return 64 if self.gcn_arch(index).startswith("gfx9") else 32

    def _bf16_native(self) -> bool:
        return self.gcn_arch().startswith(BF16_ARCHS)

    def _fp8_native(self) -> bool:
        return bool(self.fp8_dtypes())

    def fp8_dtypes(self) -> tuple[torch.dtype, ...]:
        arch = self.gcn_arch()
        if arch.startswith(FNUZ_FP8_ARCHS):
            names = ("float8_e4m3fnuz", "float8_e5m2fnuz")
        elif arch.startswith(OCP_FP8_ARCHS):
            names = ("float8_e4m3fn", "float8_e5m2")
        else:
            return ()
        return tuple(getattr(torch, n) for n in names if hasattr(torch, n))

    def triton_device_support(self) -> tuple[bool, str]:
        try:
            backends = importlib.import_module("triton.backends").backends
        except Exception as exc:  # noqa: BLE001
            return False, f"triton's backend registry is unreadable ({type(exc).__name__}: {exc})"
        if "amd" not in backends:
            return False, ("this triton has no AMD backend (install the ROCm build of triton, "
                           "e.g. pytorch-triton-rocm)")
        arch = self.gcn_arch()
        if not arch.startswith(TRITON_ARCHS):
            return False, f"{arch or 'this GPU'} is not an architecture Triton's AMD backend supports {TRITON_ARCHS}"
        return True, ""

    def describe(self) -> str:
        try:
            props = torch.cuda.get_device_properties(self.current_device())
            return f"{self.name}: {props.name} ({self.gcn_arch()}, {props.total_memory / 2**30:.0f} GiB)"
        except Exception:  # noqa: BLE001
            return super().describe()

    def report_facts(self) -> dict | None:
        facts = super().report_facts()
        if facts is not None:
            facts["wavefront_size"] = self.warp_size()
        return facts
