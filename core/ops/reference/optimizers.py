"""Reference multi-tensor optimizer steps (in place, math in fp32, one tensor at a time).

Shared semantics of every builder:

* ``params``, ``grads`` and the state lists are equally long and element-wise equal in
  shape; states may be fp32 for 16-bit params (then the param is written back rounded).
* ``step`` is the step number *after* incrementing (1 for the first step); an int or a
  0-d tensor (so a captured device graph can advance it).
* ``weight_decay`` is decoupled (``p *= 1 - lr*wd``) when ``adam_w_mode`` else added to
  the gradient (L2), exactly as ``torch.optim.AdamW`` / ``torch.optim.Adam``.
"""

from __future__ import annotations

import math

import torch

from ...errors import OpArgumentError


def upcast(t: torch.Tensor) -> torch.Tensor:
    """Math dtype of the reference: fp32 for 16-bit tensors, the tensor's own dtype otherwise."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _step_value(step) -> float:
    return float(step.item()) if isinstance(step, torch.Tensor) else float(step)


def check_lists(name: str, *lists) -> None:
    n = len(lists[0])
    for lst in lists[1:]:
        if len(lst) != n:
            raise OpArgumentError(f"{name}: tensor lists differ in length ({[len(x) for x in lists]})")
    for i, group in enumerate(zip(*lists, strict=True)):
        shape = group[0].shape
        for t in group[1:]:
            if t.shape != shape:
                raise OpArgumentError(f"{name}: tensor {i} has mismatched shapes {[tuple(x.shape) for x in group]}")
            if t.device != group[0].device:
                raise OpArgumentError(f"{name}: tensor {i} spans devices {[str(x.device) for x in group]}")


def fused_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
               adam_w_mode=True, bias_correction=True):
    """One Adam / AdamW step over lists of tensors, in place. Returns None.

    `params`, `grads`, `exp_avgs` (first moments) and `exp_avg_sqs` (second moments) are
    equally long lists of tensors on one device, element-wise equal in shape; every other
    argument is keyword-only (`polyaccel.ops` passes them by name). `step` is the step
    number after incrementing (1 on the first step): an int or a 0-d tensor (a captured
    device graph advances it on the device). Per tensor, in fp32 for 16-bit tensors and in
    the tensor's own dtype otherwise (the states may be fp32 for 16-bit params):

        g = grad + weight_decay * p                      # L2, only when not adam_w_mode
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step  # 1, 1 when not bias_correction
        p = p * (1 - lr * weight_decay)                  # decoupled, only when adam_w_mode
        p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

    `p`, `m` and `v` are written back into `params`, `exp_avgs` and `exp_avg_sqs` (rounded
    to each tensor's dtype); `grads` are only read; zero-size tensors are left alone. The
    same update as `torch.optim.AdamW` (adam_w_mode) and `torch.optim.Adam`.

    Where these formulas give NaN or an infinity (a non-finite gradient), the
    result is NaN or an infinity too, which of the two unspecified (torch's CUDA fused Adam
    turns some infinite moments into NaN); a finite result never becomes non-finite, and a
    non-finite one never becomes finite.
    """
    check_lists("fused_adam", params, grads, exp_avgs, exp_avg_sqs)
    s = _step_value(step)
    bc1 = 1.0 - beta1 ** s if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** s if bias_correction else 1.0
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if p.numel() == 0:
            continue
        p32, g32, m32, v32 = upcast(p), upcast(g), upcast(m), upcast(v)
        if weight_decay and not adam_w_mode:
            g32 = g32 + weight_decay * p32
        m32 = beta1 * m32 + (1 - beta1) * g32
        v32 = beta2 * v32 + (1 - beta2) * g32 * g32
        denom = v32.sqrt() / math.sqrt(bc2) + eps
        if weight_decay and adam_w_mode:
            p32 = p32 * (1 - lr * weight_decay)
        p32 = p32 - (lr / bc1) * (m32 / denom)
        p.copy_(p32)
        m.copy_(m32)
        v.copy_(v32)


def fused_lion(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay):
    """One Lion step over lists of tensors, in place. Returns None.

    `params`, `grads` and `exp_avgs` (momentum) as in `fused_adam`; the hyperparameters
    are keyword-only, and there is no step count. Per tensor, with fp32 math for 16-bit
    tensors:

        update = sign(beta1 * m + (1 - beta1) * grad)
        p = p * (1 - lr * weight_decay) - lr * update
        m = beta2 * m + (1 - beta2) * grad

    `p` and `m` are written back in place; `grads` are only read; zero-size tensors are
    left alone. Where these formulas give NaN or an infinity (a non-finite gradient), the
    result is NaN or an infinity too, which of the two unspecified (torch's CUDA fused Adam
    turns some infinite moments into NaN); a finite result never becomes non-finite, and a
    non-finite one never becomes finite.
    """
    check_lists("fused_lion", params, grads, exp_avgs)
    for p, g, m in zip(params, grads, exp_avgs, strict=True):
        if p.numel() == 0:
            continue
        p32, g32, m32 = upcast(p), upcast(g), upcast(m)
        update = torch.sign(beta1 * m32 + (1 - beta1) * g32)
        p32 = p32 * (1 - lr * weight_decay) - lr * update
        p.copy_(p32)
        m.copy_(beta2 * m32 + (1 - beta2) * g32)


def lamb_trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, min_coeff: float, max_coeff: float):
    """``clamp(|w|/|u|, min, max)`` where both norms are positive, else 1 (per tensor)."""
    ratio = (w_norm / u_norm).clamp(min_coeff, max_coeff)
    return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))


def fused_lamb(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
               bias_correction=True, max_coeff=10.0, min_coeff=0.01):
    """One LAMB step over lists of tensors, in place. Returns None.

    Arguments as in `fused_adam` (lists first, then keyword-only hyperparameters; `step`
    an int or a 0-d tensor); `max_coeff` and `min_coeff` bound the trust ratio. Per tensor,
    with fp32 math for 16-bit tensors:

        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad * grad
        bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step  # 1, 1 when not bias_correction
        u = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p
        trust = clamp(norm(p) / norm(u), min_coeff, max_coeff)  # 1 when either norm is 0
        p = p - lr * trust * u

    The norms are each tensor's own (not the whole list's). `p`, `m` and `v` are written
    back in place; `grads` are only read; zero-size tensors are left alone.

    Where these formulas give NaN or an infinity (a non-finite gradient), the
    result is NaN or an infinity too, which of the two unspecified (torch's CUDA fused Adam
    turns some infinite moments into NaN); a finite result never becomes non-finite, and a
    non-finite one never becomes finite.
    """
    check_lists("fused_lamb", params, grads, exp_avgs, exp_avg_sqs)
    s = _step_value(step)
    bc1 = 1.0 - beta1 ** s if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** s if bias_correction else 1.0
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if p.numel() == 0:
            continue
        p32, g32, m32, v32 = upcast(p), upcast(g), upcast(m), upcast(v)
        m32 = beta1 * m32 + (1 - beta1) * g32
        v32 = beta2 * v32 + (1 - beta2) * g32 * g32
        update = (m32 / bc1) / ((v32 / bc2).sqrt() + eps) + weight_decay * p32
        trust = lamb_trust_ratio(p32.norm(), update.norm(), min_coeff, max_coeff)
        p.copy_(p32 - lr * trust * update)
        m.copy_(m32)
        v.copy_(v32)
