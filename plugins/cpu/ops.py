"""cpu op builders: torch's fused CPU Adam kernel, and foreach (no per-tensor Python) Lion/Lamb."""

from __future__ import annotations

import math

import torch

from polyaccel.ops import OpBuilder
from polyaccel.ops.reference import optimizers as ref


def _same_dtype(*lists) -> bool:
    dt = lists[0][0].dtype
    return all(t.dtype == dt for lst in lists for t in lst)


def _nonempty(*lists):
    keep = [i for i, p in enumerate(lists[0]) if p.numel()]
    if len(keep) == len(lists[0]):
        return lists
    return tuple([lst[i] for i in keep] for lst in lists)


def _steps_tensor(step) -> torch.Tensor:
    if isinstance(step, torch.Tensor):
        return step.detach().to(device="cpu", dtype=torch.float32).reshape(())
    return torch.tensor(float(step), dtype=torch.float32)


def fused_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
               adam_w_mode=True, bias_correction=True):
    ref.check_lists("fused_adam", params, grads, exp_avgs, exp_avg_sqs)
    params, grads, exp_avgs, exp_avg_sqs = _nonempty(params, grads, exp_avgs, exp_avg_sqs)
    if not params:
        return
    if bias_correction and _same_dtype(params, grads, exp_avgs, exp_avg_sqs):
        kernel = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
        steps = [_steps_tensor(step)] * len(params)
        kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    _foreach_adam(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay, step=float(_steps_tensor(step)), adam_w_mode=adam_w_mode,
                  bias_correction=bias_correction)


def _as_fp32(lst):
    """Math dtype per tensor: fp32 for 16-bit tensors, float32/float64 unchanged."""
    return [ref.upcast(t) for t in lst]


def _write_back(dst, src):
    for d, s in zip(dst, src):
        if d is not s:
            d.copy_(s)


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
        _write_back(dst, src)


def fused_lion(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay):
    ref.check_lists("fused_lion", params, grads, exp_avgs)
    params, grads, exp_avgs = _nonempty(params, grads, exp_avgs)
    if not params:
        return
    p32, g32, m32 = (_as_fp32(x) for x in (params, grads, exp_avgs))
    update = torch._foreach_lerp(m32, g32, 1 - beta1)
    torch._foreach_sign_(update)
    if weight_decay:
        torch._foreach_mul_(p32, 1 - lr * weight_decay)
    torch._foreach_add_(p32, update, alpha=-lr)
    torch._foreach_lerp_(m32, g32, 1 - beta2)
    _write_back(params, p32)
    _write_back(exp_avgs, m32)


def fused_lamb(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
               bias_correction=True, max_coeff=10.0, min_coeff=0.01):
    ref.check_lists("fused_lamb", params, grads, exp_avgs, exp_avg_sqs)
    params, grads, exp_avgs, exp_avg_sqs = _nonempty(params, grads, exp_avgs, exp_avg_sqs)
    if not params:
        return
    s = float(_steps_tensor(step))
    bc1 = 1 - beta1**s if bias_correction else 1.0
    bc2 = 1 - beta2**s if bias_correction else 1.0
    p32, g32, m32, v32 = (_as_fp32(x) for x in (params, grads, exp_avgs, exp_avg_sqs))
    torch._foreach_lerp_(m32, g32, 1 - beta1)
    torch._foreach_mul_(v32, beta2)
    torch._foreach_addcmul_(v32, g32, g32, value=1 - beta2)
    denom = torch._foreach_div(v32, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(m32, bc1)
    torch._foreach_div_(update, denom)
    if weight_decay:
        torch._foreach_add_(update, p32, alpha=weight_decay)
    w_norm = torch.stack(torch._foreach_norm(p32))
    u_norm = torch.stack(torch._foreach_norm(update))
    trust = ref.lamb_trust_ratio(w_norm, u_norm, min_coeff, max_coeff)
    torch._foreach_mul_(update, (trust * -lr).tolist())
    torch._foreach_add_(p32, update)
    for dst, src in ((params, p32), (exp_avgs, m32), (exp_avg_sqs, v32)):
        _write_back(dst, src)


def register(registry) -> None:
    for op, fn, what in (
        ("fused_adam", fused_adam, "torch's fused CPU Adam/AdamW kernel (foreach fp32 for mixed dtypes)"),
        ("fused_lion", fused_lion, "torch foreach ops, fp32 math"),
        ("fused_lamb", fused_lamb, "torch foreach ops, fp32 math, per-tensor trust ratios"),
    ):
        registry.add(OpBuilder(op=op, name=f"cpu_{op}", device_types=("cpu",), loader=lambda fn=fn: fn,
                               kind="torch", priority=10, description=what))
