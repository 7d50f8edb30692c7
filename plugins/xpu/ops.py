"""xpu op builders: Adam/AdamW through torch's fused kernel for device type "xpu".

torch ships a fused Adam kernel for XPU (``torch._fused_adam_`` / ``torch._fused_adamw_``,
the kernel behind ``torch.optim.Adam(fused=True)``). It needs one dtype across params,
grads and states and always applies bias correction; other calls take a foreach path
with fp32 math (still no per-element Python). Lion and Lamb use torch's foreach ops.
"""

from __future__ import annotations

from polyaccel.ops import OpBuilder, torch_optim

DEVICE_TYPE = "xpu"


def _is_xpu(accelerator) -> tuple[bool, str]:
    if accelerator is None or accelerator.device_type != DEVICE_TYPE:
        return False, "no usable xpu accelerator"
    return True, ""


def _compatible(accelerator) -> tuple[bool, str]:
    ok, why = _is_xpu(accelerator)
    return torch_optim.fused_kernel_support(DEVICE_TYPE) if ok else (ok, why)


def builders() -> list[OpBuilder]:
    return [
        OpBuilder(op="fused_adam", name="xpu_torch_fused_adam", device_types=(DEVICE_TYPE,),
                  loader=lambda: torch_optim.fused_adam, kind="torch", priority=50, compatible=_compatible,
                  description="torch's fused Adam/AdamW kernel for XPU (foreach fp32 math for mixed dtypes)"),
        *torch_optim.foreach_builders(DEVICE_TYPE, compatible=_is_xpu),
    ]
