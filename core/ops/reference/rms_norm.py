"""RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (offset + weight)`` over the last dimension.

The reference (:func:`rms_norm`) is plain torch differentiated by autograd: the definition. Builders
implement :func:`rms_norm_forward` / :func:`rms_norm_backward` (the closed-form backward they must
match) any way they like and wrap them with :func:`make_rms_norm`, which supplies the argument
checks and the autograd wiring.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from ...errors import OpArgumentError

#: the dtypes the op is defined for (math in fp32, fp64 for fp64 inputs)
RMS_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _real(op: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        kind = ("a tensor (reading a device tensor would synchronise; pass float(...))"
                if isinstance(value, torch.Tensor) else type(value).__name__)
        raise OpArgumentError(f"{op}: {name} must be a real number, got {kind}")
    return float(value)


def check_rms_norm_args(x, weight, eps, offset) -> None:
    """The contract of ``rms_norm``: what every builder may assume (raises OpArgumentError otherwise)."""
    op = "rms_norm"
    if not isinstance(x, torch.Tensor):
        raise OpArgumentError(f"{op}: x must be a tensor, got {type(x).__name__}")
    if x.dtype not in RMS_NORM_DTYPES or x.layout != torch.strided:
        raise OpArgumentError(f"{op}: x is a {x.layout} tensor of dtype {x.dtype}; the op takes dense tensors of "
                              f"{', '.join(str(d) for d in RMS_NORM_DTYPES)}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise OpArgumentError(f"{op}: x has shape {tuple(x.shape)}; it normalises over the last dimension, which "
                              "must exist and hold at least one element")
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise OpArgumentError(f"{op}: weight must be a tensor or None, got {type(weight).__name__}")
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise OpArgumentError(f"{op}: weight has shape {tuple(weight.shape)} but x's last dimension is "
                                  f"{x.shape[-1]}; pass a 1-D weight of {x.shape[-1]} elements")
        if weight.dtype not in RMS_NORM_DTYPES or weight.layout != torch.strided:
            raise OpArgumentError(f"{op}: weight is a {weight.layout} tensor of dtype {weight.dtype}; pass a dense "
                                  "floating-point tensor (fp32, bf16, fp16 or fp64)")
        if weight.device != x.device:
            raise OpArgumentError(f"{op}: weight is on {weight.device} but x is on {x.device}; pass both on one "
                                  "device")
    e = _real(op, "eps", eps)
    if not (math.isfinite(e) and e >= 0):
        raise OpArgumentError(f"{op}: eps={eps!r} is not allowed; eps must be a finite number >= 0 (1e-6 is usual)")
    o = _real(op, "offset", offset)
    if not math.isfinite(o):
        raise OpArgumentError(f"{op}: offset={offset!r} is not allowed; offset must be a finite number (0.0, or 1.0 "
                              "for the (1 + weight) form)")
    if weight is None and o != 0.0:
        raise OpArgumentError(f"{op}: offset={offset!r} with weight=None; the offset is added to the weight, so "
                              "pass the weight (or offset=0.0 for an unscaled norm)")


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float):
    """``(y, rstd)``: y in x's dtype; ``rstd = rsqrt(mean(x^2) + eps)`` per row, shape ``x.shape[:-1]``, math dtype."""
    acc = math_dtype(x.dtype)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = xf * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * (offset + weight.to(acc))
    return y.to(x.dtype), rstd


def rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                      offset: float, need_dx: bool = True, need_dw: bool = True):
    """``(dx, dw)`` (either None when not needed) of ``y = x * rstd * (offset + weight)``, in closed form.

    With ``xhat = x * rstd`` and ``g = grad_out * (offset + weight)``:
    ``dx = rstd * (g - xhat * mean(g * xhat))`` and ``dw = sum over rows of grad_out * xhat``.
    """
    acc = math_dtype(x.dtype)
    xhat = x.to(acc) * rstd.unsqueeze(-1).to(acc)
    go = grad_out.to(acc)
    dx = dw = None
    if need_dx:
        g = go if weight is None else go * (offset + weight.to(acc))
        dx = (rstd.unsqueeze(-1) * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
    if need_dw and weight is not None:
        dw = (go * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx, dw


def make_rms_norm(forward, backward):
    """Build an autograd-aware rms_norm op from a forward and a backward kernel.

    ``forward(x, weight, eps, offset) -> (y, saved)`` and ``backward(grad_out, x, weight, saved, offset, need_dx,
    need_dw) -> (dx, dw)`` compute the reference's math (:func:`rms_norm_forward`, :func:`rms_norm_backward`;
    ``saved`` is whatever tensor the forward keeps for the backward, e.g. the rows' ``rstd``, or None);
    ``grad_out`` arrives contiguous. The returned ``rms_norm(x, weight, eps=1e-6, *, offset=0.0)`` checks its
    arguments and saves ``x``, ``weight`` and ``saved`` for backward; its ``unchecked`` attribute is the same
    without the check (the entry point ``polyaccel.ops.rms_norm`` checks before resolving the builder).
    """

    class _RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps, offset):
            y, saved = forward(x, weight, eps, offset)
            ctx.save_for_backward(x, weight, saved)
            ctx.offset = offset
            return y

        @staticmethod
        def backward(ctx, grad_out):
            x, weight, saved = ctx.saved_tensors
            dx, dw = backward(grad_out.contiguous(), x, weight, saved, ctx.offset, ctx.needs_input_grad[0],
                              ctx.needs_input_grad[1])
            return dx, dw, None, None

    def unchecked(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                  offset: float = 0.0) -> torch.Tensor:
        return _RMSNorm.apply(x, weight, float(eps), float(offset))

    def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                 offset: float = 0.0) -> torch.Tensor:
        check_rms_norm_args(x, weight, eps, offset)
        return _RMSNorm.apply(x, weight, float(eps), float(offset))

    rms_norm.unchecked = unchecked  # for polyaccel.ops.rms_norm, which has checked the call already
    return rms_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dimension, `(x * rsqrt(mean(x^2, -1) + eps)) * (offset + weight)`; differentiable.

    Called as `fn(x, weight, eps=1e-6, *, offset=0.0)`: `x` is `[..., H]` (H >= 1; fp32, bf16,
    fp16 or fp64), `weight` is `[H]` of any of those dtypes on x's device, or None (no scale;
    offset must then be 0). `eps` is a finite number >= 0, `offset` a finite number: 1.0 gives
    the `(1 + weight)` form of Gemma. Math in fp32 (fp64 for fp64 `x`), one rounding to x's
    dtype at the end: the result has x's shape and dtype. With `rstd = rsqrt(mean(x^2) + eps)`,
    `xhat = x * rstd` and `g = grad_out * (offset + weight)`:

        y  = xhat * (offset + weight)
        dx = rstd * (g - xhat * mean(g * xhat, -1))
        dw = sum over all rows of grad_out * xhat                    (in weight's dtype)

    Any strides are accepted. Build a builder's function with `make_rms_norm(forward, backward)`
    (from `polyaccel.ops.reference.rms_norm`): it supplies the argument checks and the autograd wiring.
    """
    check_rms_norm_args(x, weight, eps, offset)
    acc = math_dtype(x.dtype)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (offset + weight.to(acc))
    return y.to(x.dtype)
