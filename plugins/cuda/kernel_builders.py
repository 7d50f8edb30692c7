"""Op builders of the cuda plugin for quantize/dequantize, swiglu, grouped_mm and gather_sum (device type "cuda").

The plugin's ``polyaccel_register_ops`` hook calls :func:`register`. Importing this module
loads neither Triton nor a kernel: loaders import the kernel modules on first use, and the
``compatible`` checks are cheap questions about the accelerator serving "cuda".

fp8: the ``quantize`` / ``dequantize`` builders serve every mode. fp8 (e4m3) needs compute
capability 8.9 or newer for Triton's conversions; on an older GPU the builder stays chosen
for int8/int4 and an fp8 call raises ``polyaccel.Unsupported`` naming the cuda plugin (with the
override to the reference in its hint). :func:`fp8_compatible` answers the same question up
front, for capability reports.
"""

from __future__ import annotations

import torch
from polyaccel.ops import OpBuilder

from .triton_support import triton_compatible

#: compute capability from which Triton converts to and from e4m3
FP8_MIN_CAPABILITY = (8, 9)
#: compute capability torch._grouped_mm's CUTLASS kernels are built for
GROUPED_MM_MIN_CAPABILITY = (9, 0)

TRITON_PRIORITY = 50
TORCH_GROUPED_MM_PRIORITY = 60


def _capability(accelerator) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(accelerator.current_device()))


def fp8_compatible(accelerator) -> tuple[bool, str]:
    """(ok, reason) for fp8 (e4m3) quantize/dequantize through the Triton builder."""
    ok, why = triton_compatible(accelerator)
    if not ok:
        return False, why
    if getattr(torch.version, "hip", None):
        dtypes = accelerator.fp8_dtypes() if hasattr(accelerator, "fp8_dtypes") else ()
        if torch.float8_e4m3fn not in dtypes:
            return False, f"the kernels write float8_e4m3fn; this GPU's fp8 formats are {list(map(str, dtypes))}"
        return True, ""
    cap = _capability(accelerator)
    if cap < FP8_MIN_CAPABILITY:
        return False, (f"compute capability {cap[0]}.{cap[1]} has no e4m3 conversions "
                       f"(needs {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+); int8 and int4 still run")
    return True, ""


def torch_grouped_mm_compatible(accelerator) -> tuple[bool, str]:
    """(ok, reason) for the ``torch._grouped_mm`` builder."""
    if accelerator is None:
        return False, "no usable accelerator serves this device type (no CUDA GPU here)"
    if accelerator.device_type != "cuda":
        return False, f"{accelerator.name} uses device type {accelerator.device_type!r}, not 'cuda'"
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm (added in torch 2.8)"
    if getattr(torch.version, "hip", None):
        return False, "torch._grouped_mm is not verified on ROCm by this plugin"
    probe = accelerator.probe()
    if not probe.available:
        return False, f"{accelerator.name} is not usable here: {probe.reason}"
    if accelerator.is_emulated():
        return False, f"{accelerator.name} runs on an emulated runtime"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    cap = _capability(accelerator)
    if cap < GROUPED_MM_MIN_CAPABILITY:
        return False, (f"torch._grouped_mm's CUTLASS kernels need compute capability "
                       f"{GROUPED_MM_MIN_CAPABILITY[0]}.{GROUPED_MM_MIN_CAPABILITY[1]}+, this GPU is {cap[0]}.{cap[1]}")
    return True, ""


def _load(module: str, attr: str):
    def load():
        import importlib

        return getattr(importlib.import_module(f"{__package__}.kernels.{module}"), attr)

    return load


def builders() -> list[OpBuilder]:
    """Every builder this module contributes (fresh objects: a registry owns what it is given)."""
    cuda = ("cuda",)
    return [
        OpBuilder(op="quantize", name="triton_quantize", device_types=cuda, loader=_load("quantize", "quantize"),
                  kind="triton", priority=TRITON_PRIORITY, compatible=triton_compatible,
                  description="Triton group-wise quantize: int8/int4 sym/asym on any Triton GPU; fp8 e4m3 on "
                              "compute capability 8.9+ (older GPUs raise polyaccel.Unsupported for fp8)"),
        OpBuilder(op="dequantize", name="triton_dequantize", device_types=cuda,
                  loader=_load("quantize", "dequantize"), kind="triton", priority=TRITON_PRIORITY,
                  compatible=triton_compatible,
                  description="Triton group-wise dequantize (int8, int4; fp8 on compute capability 8.9+)"),
        OpBuilder(op="swiglu", name="triton_swiglu", device_types=cuda, loader=_load("swiglu", "swiglu"),
                  kind="triton", priority=TRITON_PRIORITY, compatible=triton_compatible,
                  description="Triton SwiGLU: one fused forward and one fused backward kernel, autograd-aware"),
        OpBuilder(op="grouped_mm", name="triton_grouped_mm", device_types=cuda,
                  loader=_load("grouped_mm", "grouped_mm"), kind="triton", priority=TRITON_PRIORITY,
                  compatible=triton_compatible,
                  description="Triton grouped GEMM, one launch for all experts, 64-bit offsets, bf16/fp16/fp32, "
                              "autograd-aware"),
        OpBuilder(op="gather_sum", name="triton_gather_sum", device_types=cuda,
                  loader=_load("gather_sum", "gather_sum"), kind="triton", priority=TRITON_PRIORITY,
                  compatible=triton_compatible,
                  description="Triton gather-sum: one pass over the rows forward, one backward (weights' gradient "
                              "included), no atomics, autograd-aware"),
        OpBuilder(op="grouped_mm", name="torch_grouped_mm", device_types=cuda,
                  loader=_load("grouped_mm", "torch_grouped_mm"), kind="torch",
                  priority=TORCH_GROUPED_MM_PRIORITY, compatible=torch_grouped_mm_compatible,
                  description="torch._grouped_mm (CUTLASS, bf16) with the rows past the last offset zeroed; "
                              "other dtypes or unaligned shapes go to the reference"),
    ]
