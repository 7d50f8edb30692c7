"""mps op builders: a Metal FusedAdam kernel, falling back to torch's fused Adam on mps.

Preference: the Metal kernel (``torch.mps.compile_shader``, torch >= 2.6) > torch's fused
Adam kernel for mps (``torch._fused_adam_``/``torch._fused_adamw_``) > the reference.
Lion and Lamb use torch's foreach ops on mps.
"""

from __future__ import annotations

import torch
from polyaccel.ops import OpBuilder, torch_optim

DEVICE_TYPE = "mps"


def _is_mps(accelerator) -> tuple[bool, str]:
    if accelerator is None or accelerator.device_type != DEVICE_TYPE:
        return False, "no usable mps accelerator"
    return True, ""


def metal_compatible(accelerator) -> tuple[bool, str]:
    ok, why = _is_mps(accelerator)
    if not ok:
        return ok, why
    if not hasattr(torch.mps, "compile_shader"):
        return False, f"torch {torch.__version__} has no torch.mps.compile_shader; a torch that ships it is needed"
    return True, ""


def torch_fused_compatible(accelerator) -> tuple[bool, str]:
    ok, why = _is_mps(accelerator)
    return torch_optim.fused_kernel_support(DEVICE_TYPE) if ok else (ok, why)


#: torch's fused Adam kernel for mps per dtype group; foreach where its preconditions do not hold
torch_fused_adam = torch_optim.fused_adam


def _load_metal():
    from .metal_adam import MetalFusedAdam

    return MetalFusedAdam(fallback=torch_fused_adam)


def builders() -> list[OpBuilder]:
    return [
        OpBuilder(op="fused_adam", name="mps_metal_fused_adam", device_types=(DEVICE_TYPE,), loader=_load_metal,
                  kind="native", priority=60, compatible=metal_compatible,
                  description="Metal kernel compiled with torch.mps.compile_shader, fp32 math"),
        OpBuilder(op="fused_adam", name="mps_torch_fused_adam", device_types=(DEVICE_TYPE,),
                  loader=lambda: torch_fused_adam, kind="torch", priority=50, compatible=torch_fused_compatible,
                  description="torch's fused Adam/AdamW kernel for mps (foreach fp32 math for mixed dtypes)"),
        *torch_optim.foreach_builders(DEVICE_TYPE, compatible=_is_mps),
    ]
