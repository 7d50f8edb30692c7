"""xpu op builders: Adam/AdamW through torch's fused kernel for device type "xpu".

torch ships a fused Adam kernel for XPU (``torch._fused_adam_`` / ``torch._fused_adamw_``,
the kernel behind ``torch.optim.Adam(fused=True)``). It needs one dtype across params,
grads and states and always applies bias correction; other calls take a foreach path
with fp32 math (still no per-element Python). Lion and Lamb use the reference.
"""

from __future__ import annotations

import math

import torch
from polyaccel.ops import OpBuilder
from polyaccel.ops.reference import optimizers as ref

DEVICE_TYPE = "xpu"


def fused_kernel_support(device_type: str = DEVICE_TYPE) -> tuple[bool, str]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    if device_type in _get_fused_kernels_supported_devices():
        return True, ""
    return False, f"torch {torch.__version__} has no fused Adam kernel for {device_type!r}"


def _nonempty(*lists):
    keep = [i for i, p in enumerate(lists[0]) if p.numel()]
    return tuple([lst[i] for i in keep] for lst in lists)


def _step_tensor(step, device) -> torch.Tensor:
    if isinstance(step, torch.Tensor):
        return step.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(step), dtype=torch.float32, device=device)


def _as_fp32(lst):
    return [t if t.dtype == torch.float32 else t.float() for t in lst]


def _foreach_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                  adam_w_mode, bias_correction):
    p32, g32, m32, v32 = (_as_fp32(x) for x in (params, grads, exp_avgs, exp_avg_sqs))
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
    ref.check_lists("fused_adam", params, grads, exp_avgs, exp_avg_sqs)
    params, grads, exp_avgs, exp_avg_sqs = _nonempty(params, grads, exp_avgs, exp_avg_sqs)
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


def _compatible(accelerator) -> tuple[bool, str]:
    if accelerator is None or accelerator.device_type != DEVICE_TYPE:
        return False, "no usable xpu accelerator"
    return fused_kernel_support()


def register(registry) -> None:
    registry.add(OpBuilder(
        op="fused_adam", name="xpu_torch_fused_adam", device_types=(DEVICE_TYPE,),
        loader=lambda: torch_fused_adam, kind="torch", priority=50, compatible=_compatible,
        description="torch's fused Adam/AdamW kernel for XPU (foreach fp32 math for mixed dtypes)"))
