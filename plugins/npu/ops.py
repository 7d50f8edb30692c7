"""npu op builders.

* ``fused_adam``: torch's fused Adam/AdamW interface (``torch._fused_adam_`` /
  ``torch._fused_adamw_``), which torch_npu implements for npu tensors; the deprecated
  per-tensor ``torch_npu.npu_apply_adam*`` ops are not used. Lists mixing dtypes (16-bit
  params with fp32 states) or ``bias_correction=False`` take a foreach path with fp32 math.
* ``fused_lion`` / ``fused_lamb``: ``torch._foreach_*`` ops (one launch per op over the
  whole list, served by torch_npu's foreach kernels), fp32 math.
* ``quantize`` (int8/int4, symmetric and asymmetric): group scales computed with torch,
  rounding and saturation by ``torch_npu.npu_quantize``; fp8 goes to the reference.
"""

from __future__ import annotations

import sys

import torch
from polyaccel.ops import OpBuilder
from polyaccel.ops.reference import optimizers as ref_optim
from polyaccel.ops.reference.quantize import QuantizedTensor, check_quantize_args, pack_int4, qmax
from polyaccel.ops.reference.quantize import quantize as reference_quantize

HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------- compatibility
def _npu_accelerator(acc) -> tuple[bool, str]:
    if acc is None or acc.name != "npu":
        return False, "needs the npu accelerator (torch_npu on an Ascend host)"
    return True, ""


def _fused_adam_compatible(acc) -> tuple[bool, str]:
    ok, why = _npu_accelerator(acc)
    if not ok:
        return ok, why
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    if "npu" not in _get_fused_kernels_supported_devices():
        return False, "torch's fused Adam lists no npu kernel in this torch/torch_npu pair"
    return True, ""


def _quantize_compatible(acc) -> tuple[bool, str]:
    ok, why = _npu_accelerator(acc)
    if not ok:
        return ok, why
    if not hasattr(sys.modules.get("torch_npu"), "npu_quantize"):
        return False, "this torch_npu has no npu_quantize"
    return True, ""


# ---------------------------------------------------------------------- helpers
def _live(*lists):
    """Drop empty tensors (kernels reject them; they have nothing to update)."""
    keep = [i for i, p in enumerate(lists[0]) if p.numel()]
    return tuple([lst[i] for i in keep] for lst in lists)


def _fp32(tensors):
    return [t.float() if t.dtype in HALF else t for t in tensors]


def _copy_back(dst, src) -> None:
    for d, s in zip(dst, src, strict=True):
        if d is not s:
            d.copy_(s)


def _step_float(step) -> float:
    return float(step.item()) if isinstance(step, torch.Tensor) else float(step)


def _step_tensor(step, device) -> torch.Tensor:
    """The step as the fp32 0-d tensor torch's fused kernels read (no host sync for tensors)."""
    if isinstance(step, torch.Tensor):
        return step.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(step), dtype=torch.float32, device=device)


# ------------------------------------------------------------------------- adam
def fused_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
               adam_w_mode=True, bias_correction=True):
    ref_optim.check_lists("fused_adam", params, grads, exp_avgs, exp_avg_sqs)
    params, grads, exp_avgs, exp_avg_sqs = _live(params, grads, exp_avgs, exp_avg_sqs)
    if not params:
        return
    fused_idx, other_idx = [], []
    for i, group in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        same = all(t.dtype == group[0].dtype for t in group)
        (fused_idx if same and bias_correction else other_idx).append(i)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in fused_idx:
        by_dtype.setdefault(params[i].dtype, []).append(i)
    kernel = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    for idx in by_dtype.values():
        steps = [_step_tensor(step, params[idx[0]].device)] * len(idx)
        kernel([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
               [exp_avg_sqs[i] for i in idx], [], steps, lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    if other_idx:
        pick = lambda lst: [lst[i] for i in other_idx]  # noqa: E731
        _foreach_adam(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), lr=lr, beta1=beta1,
                      beta2=beta2, eps=eps, weight_decay=weight_decay, step=_step_float(step),
                      adam_w_mode=adam_w_mode, bias_correction=bias_correction)


def _foreach_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                  adam_w_mode, bias_correction):
    p, g, m, v = _fp32(params), _fp32(grads), _fp32(exp_avgs), _fp32(exp_avg_sqs)
    if weight_decay and not adam_w_mode:
        g = torch._foreach_add(g, p, alpha=weight_decay)
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, g, alpha=1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    denom = torch._foreach_sqrt(v)
    torch._foreach_mul_(denom, 1 / bc2**0.5)
    torch._foreach_add_(denom, eps)
    if weight_decay and adam_w_mode:
        torch._foreach_mul_(p, 1 - lr * weight_decay)
    torch._foreach_addcdiv_(p, m, denom, value=-lr / bc1)
    _copy_back(params, p)
    _copy_back(exp_avgs, m)
    _copy_back(exp_avg_sqs, v)


# ------------------------------------------------------------------------- lion
def fused_lion(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay):
    ref_optim.check_lists("fused_lion", params, grads, exp_avgs)
    params, grads, exp_avgs = _live(params, grads, exp_avgs)
    if not params:
        return
    p, g, m = _fp32(params), _fp32(grads), _fp32(exp_avgs)
    direction = torch._foreach_mul(m, beta1)
    torch._foreach_add_(direction, g, alpha=1 - beta1)
    torch._foreach_sign_(direction)
    if weight_decay:
        torch._foreach_mul_(p, 1 - lr * weight_decay)
    torch._foreach_add_(p, direction, alpha=-lr)
    torch._foreach_mul_(m, beta2)
    torch._foreach_add_(m, g, alpha=1 - beta2)
    _copy_back(params, p)
    _copy_back(exp_avgs, m)


# ------------------------------------------------------------------------- lamb
def fused_lamb(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
               bias_correction=True, max_coeff=10.0, min_coeff=0.01):
    ref_optim.check_lists("fused_lamb", params, grads, exp_avgs, exp_avg_sqs)
    params, grads, exp_avgs, exp_avg_sqs = _live(params, grads, exp_avgs, exp_avg_sqs)
    if not params:
        return
    s = _step_float(step)
    bc1 = 1 - beta1**s if bias_correction else 1.0
    bc2 = 1 - beta2**s if bias_correction else 1.0
    p, g, m, v = _fp32(params), _fp32(grads), _fp32(exp_avgs), _fp32(exp_avg_sqs)
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, g, alpha=1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    denom = torch._foreach_mul(v, 1 / bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_mul(m, 1 / bc1)
    torch._foreach_div_(update, denom)
    if weight_decay:
        torch._foreach_add_(update, p, alpha=weight_decay)
    trust = ref_optim.lamb_trust_ratio(torch.stack(torch._foreach_norm(p)), torch.stack(torch._foreach_norm(update)),
                                       min_coeff, max_coeff)
    torch._foreach_mul_(update, list(torch.unbind(trust * -lr)))
    torch._foreach_add_(p, update)
    _copy_back(params, p)
    _copy_back(exp_avgs, m)
    _copy_back(exp_avg_sqs, v)


# --------------------------------------------------------------------- quantize
def quantize(x, mode="int8", group_size=128, symmetric=True):
    check_quantize_args(x, mode, group_size, symmetric)
    if mode == "fp8":
        return reference_quantize(x, mode, group_size, symmetric)
    torch_npu = sys.modules["torch_npu"]
    groups = x.reshape(-1, group_size).float()
    top = qmax(mode, symmetric)
    if symmetric:
        amax = groups.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
        zero = None
        out_dtype = torch.qint8
    else:
        lo = groups.amin(dim=1).clamp(max=0)
        hi = groups.amax(dim=1).clamp(min=0)
        span = hi - lo
        scale = torch.where(span > 0, span / top, torch.ones_like(span))
        zero = torch.round(-lo / scale).clamp(0, top)
        out_dtype = torch.quint8
    # npu_quantize broadcasts scales along the last axis only: put the groups there
    q = torch_npu.npu_quantize(groups.t().contiguous(), scale,
                               None if zero is None else zero.to(torch.int32), out_dtype, -1, True)
    if q.dtype in (torch.qint8, torch.quint8):
        q = q.int_repr()
    q = q.t().reshape(-1).to(torch.int16)
    q = q.clamp(-top, top) if symmetric else q.clamp(0, top)
    if mode == "int4":
        data = pack_int4(q)
    else:
        data = q.to(torch.int8 if symmetric else torch.uint8)
    zp = None if zero is None else zero.to(torch.uint8)
    return QuantizedTensor(data, scale, zp, mode, group_size, x.shape, x.dtype)


def register(registry) -> None:
    registry.add(OpBuilder(
        op="fused_adam", name="npu_torch_fused_adam", device_types=("npu",), loader=lambda: fused_adam,
        kind="torch", priority=50, compatible=_fused_adam_compatible,
        description="torch._fused_adam(w)_ on npu (torch_npu kernel); foreach fp32 for mixed dtypes"))
    for op, fn, what in (
        ("fused_lion", fused_lion, "torch._foreach_* on npu, fp32 math"),
        ("fused_lamb", fused_lamb, "torch._foreach_* on npu, fp32 math, per-tensor trust ratio"),
    ):
        registry.add(OpBuilder(op=op, name=f"npu_foreach_{op}", device_types=("npu",), loader=lambda fn=fn: fn,
                               kind="torch", priority=50, compatible=_npu_accelerator, description=what))
    registry.add(OpBuilder(
        op="quantize", name="npu_quantize", device_types=("npu",), loader=lambda: quantize, kind="vendor",
        priority=50, compatible=_quantize_compatible,
        description="group scales in torch, rounding/saturation by torch_npu.npu_quantize (fp8: reference)"))
