"""Device-generic optimizer steps on torch's own multi-tensor kernels.

Any backend whose torch device type has ``torch._foreach_*`` kernels (and, for Adam,
torch's fused Adam kernel ``torch._fused_adam_``/``torch._fused_adamw_``) can register
these as its builders instead of writing kernels: the cpu, xpu, mps and npu plugins do.
Same semantics as the reference ops; no per-element Python, one kernel per op over
the whole list.

* ``fused_adam``: torch's fused kernel for each group of tensors that share one dtype
  (it needs params, grads and states of equal dtype and always applies bias correction;
  it pairs the operands of an entry by memory position, so entries whose operands differ
  in layout run on dense copies, :mod:`polyaccel.ops.layout`); a contiguous entry whose
  gradient alone is 16-bit (an fp32 master stepped with the compute dtype's gradient) runs
  the same kernel on the gradient upcast a piece at a time into a small buffer; everything
  else (16-bit params with fp32 states, ``bias_correction=False``, a device type without
  the fused kernel) takes the foreach path.
* ``fused_lion`` / ``fused_lamb``: :func:`foreach_lion` / :func:`foreach_lamb`, on foreach ops;
  :func:`foreach_builders` makes a backend's builders for them.

Math runs in fp32 for 16-bit tensors and in the tensor's own dtype otherwise. The foreach
paths take any strides: torch's foreach ops fall back to per-tensor (stride-aware) kernels
where the operands' layouts differ.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import layout
from .reference import optimizers as ref
from .registry import OpBuilder

#: the lists of (params, grads, exp_avgs, exp_avg_sqs) an Adam step writes
ADAM_WRITTEN = frozenset((0, 2, 3))
#: elements of a 16-bit gradient upcast at a time for the fused kernel: the foreach path for such an entry
#: ran 5x slower than the fused kernel on the CPU, the upcast pieces 1.3x (20M elements, 2 cores)
UPCAST_PIECE = 1 << 20


def fused_kernel_support(device_type: str) -> tuple[bool, str]:
    """Whether torch ships its fused Adam kernel for ``device_type`` (``(ok, reason)``)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    if device_type in _get_fused_kernels_supported_devices():
        return True, ""
    return False, f"torch {torch.__version__} has no fused Adam kernel for device type {device_type!r}"


def _live(*lists):
    """Drop zero-size tensors: there is nothing to update and some kernels reject them."""
    keep = [i for i, p in enumerate(lists[0]) if p.numel()]
    if len(keep) == len(lists[0]):
        return lists
    return tuple([lst[i] for i in keep] for lst in lists)


def _math(tensors):
    return [ref.upcast(t) for t in tensors]


def _copy_back(dst, src) -> None:
    for d, s in zip(dst, src, strict=True):
        if d is not s:
            d.copy_(s)


def _moment_(m, g, beta) -> None:
    """``m = beta * m + (1 - beta) * g`` in place, as the reference writes it.

    Not ``torch._foreach_lerp_``: for weights of 0.5 and more lerp computes ``g - (g - m) * (1 - w)``,
    which turns an infinite gradient into NaN (``inf - inf * 0``) where the contract gives an infinite moment.
    """
    torch._foreach_mul_(m, beta)
    torch._foreach_add_(m, g, alpha=1 - beta)


def _step_float(step) -> float:
    return float(step.item()) if isinstance(step, torch.Tensor) else float(step)


def _step_tensor(step, device) -> torch.Tensor:
    """The step as the fp32 0-d tensor torch's fused kernels read, without a host sync: a tensor step is moved
    as it is, an int is filled in on the device (a copy of a host tensor would first wait for the device)."""
    if isinstance(step, torch.Tensor):
        return step.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(step), dtype=torch.float32, device=device)


def fused_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
               adam_w_mode=True, bias_correction=True):
    ref.check_lists("fused_adam", params, grads, exp_avgs, exp_avg_sqs)
    params, grads, exp_avgs, exp_avg_sqs = _live(params, grads, exp_avgs, exp_avg_sqs)
    if not params:
        return
    fused_ok = bias_correction and fused_kernel_support(params[0].device.type)[0]
    by_dtype: dict[torch.dtype, list[int]] = {}
    upcast: list[int] = []
    other: list[int] = []
    for i, group in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        if fused_ok and all(t.dtype == group[0].dtype for t in group):
            by_dtype.setdefault(group[0].dtype, []).append(i)
        elif fused_ok and _upcast_fits(*group):
            upcast.append(i)
        else:
            other.append(i)
    kernel = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    for idx in by_dtype.values():
        steps = [_step_tensor(step, params[idx[0]].device)] * len(idx)
        # the fused kernel pairs operands by memory position: entries whose layouts differ run on dense copies
        staged = layout.stage(tuple([lst[i] for i in idx] for lst in (params, grads, exp_avgs, exp_avg_sqs)),
                              ADAM_WRITTEN)
        kernel(*staged.lists, [], steps, **hyper)
        staged.copy_back()
    for i in upcast:
        _fused_on_upcast_pieces(kernel, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], step, hyper)
    if other:
        pick = lambda lst: [lst[i] for i in other]  # noqa: E731
        foreach_adam(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), lr=lr, beta1=beta1,
                     beta2=beta2, eps=eps, weight_decay=weight_decay, step=_step_float(step),
                     adam_w_mode=adam_w_mode, bias_correction=bias_correction)


def _upcast_fits(p, g, m, v) -> bool:
    """An fp32/fp64 entry whose gradient alone is narrower, every operand dense: upcast pieces of it."""
    return (p.dtype == m.dtype == v.dtype and g.dtype.itemsize < p.dtype.itemsize and g.is_floating_point()
            and all(t.is_contiguous() for t in (p, g, m, v)))


def _fused_on_upcast_pieces(kernel, p, g, m, v, step, hyper) -> None:
    """The fused kernel on ``UPCAST_PIECE`` elements at a time, each piece's gradient upcast into one buffer
    (exact: every 16-bit value is a value of the wider dtype)."""
    p, g, m, v = (t.view(-1) for t in (p, g, m, v))
    n = p.numel()
    steps = [_step_tensor(step, p.device)]
    buf = torch.empty(min(n, UPCAST_PIECE), dtype=p.dtype, device=p.device)
    for lo in range(0, n, UPCAST_PIECE):
        hi = min(n, lo + UPCAST_PIECE)
        piece = buf[:hi - lo].copy_(g[lo:hi])
        kernel([p[lo:hi]], [piece], [m[lo:hi]], [v[lo:hi]], [], steps, **hyper)


def foreach_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                 adam_w_mode=True, bias_correction=True):
    p, g, m, v = _math(params), _math(grads), _math(exp_avgs), _math(exp_avg_sqs)
    if weight_decay and not adam_w_mode:
        g = torch._foreach_add(g, p, alpha=weight_decay)
    _moment_(m, g, beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    s = _step_float(step)
    bc1 = 1 - beta1**s if bias_correction else 1.0
    bc2 = 1 - beta2**s if bias_correction else 1.0
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2**0.5)
    torch._foreach_add_(denom, eps)
    if weight_decay and adam_w_mode:
        torch._foreach_mul_(p, 1 - lr * weight_decay)
    torch._foreach_addcdiv_(p, m, denom, value=-lr / bc1)
    _copy_back(params, p)
    _copy_back(exp_avgs, m)
    _copy_back(exp_avg_sqs, v)


def foreach_lion(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay):
    ref.check_lists("fused_lion", params, grads, exp_avgs)
    params, grads, exp_avgs = _live(params, grads, exp_avgs)
    if not params:
        return
    p, g, m = _math(params), _math(grads), _math(exp_avgs)
    direction = torch._foreach_mul(m, beta1)
    torch._foreach_add_(direction, g, alpha=1 - beta1)
    torch._foreach_sign_(direction)
    if weight_decay:
        torch._foreach_mul_(p, 1 - lr * weight_decay)
    torch._foreach_add_(p, direction, alpha=-lr)
    _moment_(m, g, beta2)
    _copy_back(params, p)
    _copy_back(exp_avgs, m)


def foreach_lamb(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                 bias_correction=True, max_coeff=10.0, min_coeff=0.01):
    ref.check_lists("fused_lamb", params, grads, exp_avgs, exp_avg_sqs)
    params, grads, exp_avgs, exp_avg_sqs = _live(params, grads, exp_avgs, exp_avg_sqs)
    if not params:
        return
    s = _step_float(step)
    bc1 = 1 - beta1**s if bias_correction else 1.0
    bc2 = 1 - beta2**s if bias_correction else 1.0
    p, g, m, v = _math(params), _math(grads), _math(exp_avgs), _math(exp_avg_sqs)
    _moment_(m, g, beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    denom = torch._foreach_div(v, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(m, bc1)
    torch._foreach_div_(update, denom)
    if weight_decay:
        torch._foreach_add_(update, p, alpha=weight_decay)
    trust = ref.lamb_trust_ratio(torch.stack(torch._foreach_norm(p)), torch.stack(torch._foreach_norm(update)),
                                 min_coeff, max_coeff)
    torch._foreach_mul_(update, list(torch.unbind(trust * -lr)))
    torch._foreach_add_(p, update)
    _copy_back(params, p)
    _copy_back(exp_avgs, m)
    _copy_back(exp_avg_sqs, v)


#: op -> (its foreach implementation, what the builder says about it)
FOREACH_OPS = {
    "fused_lion": (foreach_lion, "torch._foreach_* ops, fp32 math for 16-bit tensors"),
    "fused_lamb": (foreach_lamb, "torch._foreach_* ops, fp32 math for 16-bit tensors, per-tensor trust ratios"),
}


def foreach_builders(device_type: str, *, priority: int = 50,
                     compatible: Callable[[object], tuple[bool, str]] | None = None,
                     prefix: str | None = None) -> list[OpBuilder]:
    """Builders of ``fused_lion`` and ``fused_lamb`` on ``device_type``'s ``torch._foreach_*`` kernels.

    Named ``<prefix><op>``, by default ``<device_type>_foreach_<op>``; ``compatible`` as for
    :class:`OpBuilder` (default: always compatible).
    """
    prefix = f"{device_type}_foreach_" if prefix is None else prefix
    check = {} if compatible is None else {"compatible": compatible}
    return [OpBuilder(op=op, name=f"{prefix}{op}", device_types=(device_type,), loader=lambda fn=fn: fn,
                      kind="torch", priority=priority, description=f"{what} on {device_type}", **check)
            for op, (fn, what) in FOREACH_OPS.items()]
