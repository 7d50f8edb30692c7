"""Op builders of the cuda plugin: Triton multi-tensor optimizers, and torch's fused Adam as fallback.

Triton builders are compatible only where :func:`triton_support.triton_compatible` says so;
``polyaccel.ops.explain("fused_adam", "cuda")`` shows the reason when they are not. Part of
the plugin's builders (quantize, swiglu, grouped_mm, gather_sum) live in :mod:`.kernel_builders`.
"""

from __future__ import annotations

import importlib

import torch
from polyaccel.ops import OpBuilder, torch_optim

from .triton_support import triton_compatible

TRITON_PRIORITY = 100
TORCH_PRIORITY = 50


def _triton_loader(attr: str):
    def load():
        from .kernels import optimizers

        return getattr(optimizers, attr)

    return load


#: torch's fused CUDA Adam/AdamW kernel per dtype group; foreach where its preconditions do not hold
torch_fused_adam = torch_optim.fused_adam


def _torch_cuda_compatible(accelerator) -> tuple[bool, str]:
    if accelerator is None or accelerator.device_type != "cuda":
        return False, "no usable CUDA/ROCm accelerator serves device type 'cuda' here"
    if not hasattr(torch, "_fused_adamw_"):
        return False, f"torch {torch.__version__} has no fused Adam kernel"
    return True, ""


def builders() -> list[OpBuilder]:
    found = [
        OpBuilder(op=op, name=f"triton_{op}", device_types=("cuda",), loader=_triton_loader(op), kind="triton",
                  priority=TRITON_PRIORITY, compatible=triton_compatible, description=what)
        for op, what in (
            ("fused_adam", "Triton multi-tensor Adam/AdamW: one launch over all tensors, fp32 math"),
            ("fused_lion", "Triton multi-tensor Lion: one launch over all tensors, fp32 math"),
            ("fused_lamb", "Triton multi-tensor LAMB: moments+norms, trust ratios, update (3 launches)"),
        )
    ]
    found.append(OpBuilder(op="fused_adam", name="torch_fused_adam", device_types=("cuda",),
                           loader=lambda: torch_fused_adam, kind="torch", priority=TORCH_PRIORITY,
                           compatible=_torch_cuda_compatible,
                           description="torch._fused_adam(w)_ per dtype group, else torch foreach ops"))
    try:
        kernel_builders = importlib.import_module(f"{__package__}.kernel_builders")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.kernel_builders":
            raise
        return found
    return found + kernel_builders.builders()
