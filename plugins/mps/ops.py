"""mps op builders: a Metal FusedAdam kernel, falling back to torch's fused Adam on mps.

Preference: the Metal kernel (``torch.mps.compile_shader``, torch >= 2.6) > torch's fused
Adam kernel for mps (``torch._fused_adam_``/``torch._fused_adamw_``) > the reference.
Lion and Lamb use the reference.
"""

from __future__ import annotations

import math

import torch
from polyaccel.ops import OpBuilder
from polyaccel.ops.reference import optimizers as ref

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
    if not ok:
        return ok, why
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    if DEVICE_TYPE not in _get_fused_kernels_supported_devices():
        return False, f"torch {torch.__version__} has no fused Adam kernel for mps"
    return True, ""


def _step_tensor(step, device) -> torch.Tensor:
    if isinstance(step, torch.Tensor):
        return step.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(step), dtype=torch.float32, device=device)


def _foreach_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                  adam_w_mode, bias_correction):
    p32, g32, m32, v32 = ([t.float() for t in lst] for lst in (params, grads, exp_avgs, exp_avg_sqs))
    if weight_decay and not adam_w_mode:
        g32 = torch._foreach_add(g32, p32, alpha=weight_decay)
    torch._foreach_lerp_(m32, g32, 1 - beta1)
    torch._foreach_mul_(v32, beta2)
    torch._foreach_addcmul_(v32, g32, g32, value=1 - beta2)
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    denom = torch._foreach_sqrt(v32)
    torch._foreach_div_(denom, math.sqrt(bc2))
    torch._foreach_add_(denom, eps)
    if weight_decay and adam_w_mode:
        torch._foreach_mul_(p32, 1 - lr * weight_decay)
    torch._foreach_addcdiv_(p32, m32, denom, value=-lr / bc1)
    for dst, src in ((params, p32), (exp_avgs, m32), (exp_avg_sqs, v32)):
        for d, s in zip(dst, src, strict=True):
            if d is not s:
                d.copy_(s)


def torch_fused_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                     adam_w_mode=True, bias_correction=True):
    """torch's fused Adam kernel (one dtype everywhere, bias correction on); else foreach fp32 math."""
    ref.check_lists("fused_adam", params, grads, exp_avgs, exp_avg_sqs)
    keep = [i for i, p in enumerate(params) if p.numel()]
    params, grads, exp_avgs, exp_avg_sqs = ([lst[i] for i in keep] for lst in (params, grads, exp_avgs, exp_avg_sqs))
    if not params:
        return
    dtype = params[0].dtype
    same_dtype = all(t.dtype == dtype for lst in (params, grads, exp_avgs, exp_avg_sqs) for t in lst)
    if bias_correction and same_dtype:
        kernel = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
        steps = [_step_tensor(step, params[0].device)] * len(params)
        kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    s = float(step.item()) if isinstance(step, torch.Tensor) else float(step)
    _foreach_adam(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay, step=s, adam_w_mode=adam_w_mode, bias_correction=bias_correction)


def _load_metal():
    from .metal_adam import MetalFusedAdam

    return MetalFusedAdam(fallback=torch_fused_adam)


def register(registry) -> None:
    registry.add(OpBuilder(
        op="fused_adam", name="mps_metal_fused_adam", device_types=(DEVICE_TYPE,), loader=_load_metal,
        kind="native", priority=60, compatible=metal_compatible,
        description="Metal kernel compiled with torch.mps.compile_shader, fp32 math"))
    registry.add(OpBuilder(
        op="fused_adam", name="mps_torch_fused_adam", device_types=(DEVICE_TYPE,), loader=lambda: torch_fused_adam,
        kind="torch", priority=50, compatible=torch_fused_compatible,
        description="torch's fused Adam/AdamW kernel for mps (foreach fp32 math for mixed dtypes)"))
