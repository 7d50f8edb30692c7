"""cpu builders of the model-layer ops ``rms_norm`` and ``rope``: torch, one autograd node each.

The reference differentiates its formula with autograd (several saved fp32 intermediates per call);
these compute the same math in closed form with in-place updates: RMSNorm keeps only ``x`` and one
``rstd`` per row for its backward, and takes the row's sum of squares and the backward's row dot
product as reductions without a squared temporary; RoPE rotates with two ``addcmul_`` into the
output (no ``rotate_half`` concatenation) and its backward needs only cos and sin.
"""

from __future__ import annotations

import torch
from polyaccel.ops.reference.rms_norm import make_rms_norm, math_dtype
from polyaccel.ops.reference.rope import heads_view, make_rope


# ------------------------------------------------------------------------------ rms_norm
def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float):
    acc = math_dtype(x.dtype)
    xf = x.to(acc)
    H = x.shape[-1]
    rstd = torch.linalg.vector_norm(xf, dim=-1).square_().div_(H).add_(eps).rsqrt_()
    y = xf * rstd.unsqueeze(-1)
    if weight is not None:
        y.mul_(weight.to(acc) + offset if offset else weight.to(acc))
    return y.to(x.dtype), rstd


def rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                      offset: float, need_dx: bool = True, need_dw: bool = True):
    acc = math_dtype(x.dtype)
    H = x.shape[-1]
    r = rstd.unsqueeze(-1)
    xhat = x.to(acc) * r
    go = grad_out.to(acc)
    dw = None
    if need_dw and weight is not None:
        dw = (go * xhat).reshape(-1, H).sum(0).to(weight.dtype)  # (einsum here is a batched GEMV: far slower)
    if not need_dx:
        return None, dw
    if weight is None:
        g = go.clone() if go is grad_out else go  # the update below is in place
    else:
        g = go * (weight.to(acc) + offset if offset else weight.to(acc))
    dot = (g * xhat).sum(-1, keepdim=True).div_(H)
    dx = g.addcmul_(xhat, dot, value=-1).mul_(r)
    return dx.to(x.dtype), dw


rms_norm = make_rms_norm(rms_norm_forward, rms_norm_backward)


# ---------------------------------------------------------------------------------- rope
def _rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool):
    """``x * cos + rotate(x) * sin`` (``backward``: the transposed rotation), in the math dtype, rounded once."""
    acc = math_dtype(x.dtype)
    xf = x.to(acc)
    c, s = heads_view(cos).to(acc), heads_view(sin).to(acc)
    out = xf * c
    if interleaved:
        halves = lambda t: (t[..., 0::2], t[..., 1::2])  # noqa: E731
    else:
        h = x.shape[-1] // 2
        halves = lambda t: (t[..., :h], t[..., h:])  # noqa: E731
    (x1, x2), (o1, o2), (s1, s2) = halves(xf), halves(out), halves(s)
    if backward:  # dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
        o1.addcmul_(x2, s2)
        o2.addcmul_(x1, s1, value=-1)
    else:  # y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
        o1.addcmul_(x2, s1, value=-1)
        o2.addcmul_(x1, s2)
    return out.to(x.dtype)


def rope_forward(q, k, cos, sin, interleaved: bool):
    return _rotate_into(q, cos, sin, interleaved, False), _rotate_into(k, cos, sin, interleaved, False)


def rope_backward(grad_q, grad_k, cos, sin, interleaved: bool):
    return _rotate_into(grad_q, cos, sin, interleaved, True), _rotate_into(grad_k, cos, sin, interleaved, True)


rope = make_rope(rope_forward, rope_backward)
