"""Emulated torch_npu fused model ops: ``npu_rms_norm``, ``npu_rotary_mul`` and ``npu_swiglu`` (CPU tensors,
autograd-aware).

Semantics from torch_npu's API reference (Ascend PyTorch "torch_npu.npu_rms_norm" and
"torch_npu.npu_rotary_mul" pages):

* ``npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)``: ``y = x * rsqrt(mean(x^2) + eps) * gamma``
  over gamma's trailing dimensions; ``rstd`` is the reciprocal RMS (fp32, x's shape with gamma's
  dimensions reduced to 1), kept for the backward. x has 2-8 dimensions; x and gamma are one dtype of
  float16, bfloat16, float32. Differentiable in x and gamma (RmsNormGrad).
* ``npu_rotary_mul(input, r1, r2, rotary_mode='half') -> Tensor``: ``r1 * x + r2 * x_new`` with
  ``x_new = cat(-x2, x1)`` of x's halves ("half") or each pair ``(x[2i], x[2i+1]) -> (-x[2i+1], x[2i])``
  ("interleave"). All three 4-D, r1/r2 broadcast to the input (e.g. ``[1, 1, S, D]`` or ``[B, 1, S, D]``
  for ``[B, N, S, D]``); D even and < 896; one dtype of float16, bfloat16, float32. Differentiable
  (RotaryMulGrad), r1/r2 included.
* ``npu_swiglu(input, dim=-1) -> Tensor``: ``silu(A) * B`` where A and B are the first and second halves of
  ``input`` along ``dim``. 1-8 dimensions, ``dim`` in ``[-input.dim(), input.dim() - 1]`` with an even size;
  contiguous and non-empty; one dtype of float16, bfloat16, float32. Differentiable (SwiGluGrad).

Both compute in fp32 with one rounding to the input dtype (the vendor kernels' accumulation type).
Each call is recorded on the runtime (``rt.record``) so tests can tell the vendor op ran.
"""

from __future__ import annotations

import torch

VENDOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROTARY_MODES = ("half", "interleave")
#: the largest head_dim (exclusive) the rotary kernel takes
ROTARY_MAX_D = 896


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, eps):
        dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
        y = (xf * rstd * gamma.float()).to(x.dtype)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.dims = dims
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, dy, _drstd):
        x, gamma, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g = dy.float() * gamma.float()
        dx = rstd * (g - xhat * (g * xhat).mean(ctx.dims, keepdim=True))
        lead = tuple(range(x.dim() - gamma.dim()))
        dgamma = (dy.float() * xhat).sum(lead) if lead else dy.float() * xhat
        return dx.to(x.dtype), dgamma.to(gamma.dtype), None


def npu_rms_norm(rt, x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
    rt.record("npu_rms_norm", tuple(x.shape), x.dtype, float(epsilon))
    if not 2 <= x.dim() <= 8:
        raise RuntimeError(f"npu_rms_norm: self must have 2-8 dimensions, got {x.dim()}")
    if x.dtype not in VENDOR_DTYPES or gamma.dtype != x.dtype:
        raise RuntimeError(f"npu_rms_norm: self and gamma must be one dtype of float16, bfloat16, float32; got "
                           f"{x.dtype} and {gamma.dtype}")
    if gamma.dim() > x.dim() or tuple(x.shape[x.dim() - gamma.dim():]) != tuple(gamma.shape):
        raise RuntimeError(f"npu_rms_norm: gamma {tuple(gamma.shape)} must match the trailing dimensions of self "
                           f"{tuple(x.shape)}")
    return _RmsNorm.apply(x, gamma, float(epsilon))


def _partner(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "interleave":
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _RotaryMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r1, r2, mode):
        ctx.save_for_backward(x, r1, r2)
        ctx.mode = mode
        xf = x.float()
        return (r1.float() * xf + r2.float() * _partner(xf, mode)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, r1, r2 = ctx.saved_tensors
        g = dy.float()
        # the partner map's transpose is its negative
        dx = (g * r1.float() - _partner(g * r2.float(), ctx.mode)).to(x.dtype)
        dr1 = dr2 = None
        if ctx.needs_input_grad[1]:
            dr1 = (g * x.float()).sum_to_size(r1.shape).to(r1.dtype)
        if ctx.needs_input_grad[2]:
            dr2 = (g * _partner(x.float(), ctx.mode)).sum_to_size(r2.shape).to(r2.dtype)
        return dx, dr1, dr2, None


def npu_rotary_mul(rt, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"):
    rt.record("npu_rotary_mul", tuple(x.shape), tuple(r1.shape), x.dtype, rotary_mode)
    if rotary_mode not in ROTARY_MODES:
        raise RuntimeError(f"npu_rotary_mul: rotary_mode must be one of {ROTARY_MODES}, got {rotary_mode!r}")
    if x.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        raise RuntimeError("npu_rotary_mul: input, r1 and r2 must be 4-D")
    D = x.shape[-1]
    if D % 2 or D >= ROTARY_MAX_D:
        raise RuntimeError(f"npu_rotary_mul: the last dimension must be even and < {ROTARY_MAX_D}, got {D}")
    if x.dtype not in VENDOR_DTYPES or r1.dtype != x.dtype or r2.dtype != x.dtype:
        raise RuntimeError(f"npu_rotary_mul: input, r1 and r2 must be one dtype of float16, bfloat16, float32; got "
                           f"{x.dtype}, {r1.dtype}, {r2.dtype}")
    for name, r in (("r1", r1), ("r2", r2)):
        if any(rs not in (1, xs) for rs, xs in zip(r.shape, x.shape, strict=True)):
            raise RuntimeError(f"npu_rotary_mul: {name} {tuple(r.shape)} does not broadcast to input "
                               f"{tuple(x.shape)}")
    return _RotaryMul.apply(x, r1, r2, rotary_mode)


class _SwiGlu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.save_for_backward(x)
        ctx.dim = dim
        a, b = x.float().chunk(2, dim)
        return (torch.nn.functional.silu(a) * b).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        a, b = x.float().chunk(2, ctx.dim)
        sig = torch.sigmoid(a)
        g = dy.float()
        da = g * b * sig * (1 + a * (1 - sig))
        db = g * a * sig
        return torch.cat([da, db], ctx.dim).to(x.dtype), None


def npu_swiglu(rt, input: torch.Tensor, dim: int = -1):
    rt.record("npu_swiglu", tuple(input.shape), input.dtype, dim)
    if not 1 <= input.dim() <= 8:
        raise RuntimeError(f"npu_swiglu: input must have 1-8 dimensions, got {input.dim()}")
    if not -input.dim() <= dim < input.dim():
        raise RuntimeError(f"npu_swiglu: dim {dim} is out of range for a {input.dim()}-D input")
    if input.numel() == 0 or not input.is_contiguous():
        raise RuntimeError("npu_swiglu: the input must be non-empty and contiguous")
    if input.shape[dim] % 2:
        raise RuntimeError(f"npu_swiglu: the size of dim {dim} must be even, got {input.shape[dim]}")
    if input.dtype not in VENDOR_DTYPES:
        raise RuntimeError(f"npu_swiglu: input must be float16, bfloat16 or float32, got {input.dtype}")
    return _SwiGlu.apply(input, dim)
