"""Rotary position embedding applied to q and k: ``x * cos + rotate(x) * sin``.

The reference (:func:`rope`) is plain torch differentiated by autograd: the definition. Builders
implement :func:`rope_forward` / :func:`rope_backward` (the closed form they must match) any way they
like and wrap them with :func:`make_rope`, which supplies the argument checks and the autograd wiring.
"""

from __future__ import annotations

import torch

from ...errors import OpArgumentError
from .rms_norm import math_dtype

ROPE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation's partner term: ``cat(-x2, x1)`` of the two halves (Hugging Face's ``rotate_half``), or
    for ``interleaved`` each pair ``(x[2i], x[2i+1])`` -> ``(-x[2i+1], x[2i])``."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _tensor(op: str, name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise OpArgumentError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in ROPE_DTYPES or t.layout != torch.strided:
        raise OpArgumentError(f"{op}: {name} is a {t.layout} tensor of dtype {t.dtype}; the op takes dense tensors of "
                              f"{', '.join(str(d) for d in ROPE_DTYPES)}")
    return t


def check_rope_args(q, k, cos, sin, interleaved) -> None:
    """The contract of ``rope``: what every builder may assume (raises OpArgumentError otherwise)."""
    op = "rope"
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _tensor(op, name, t)
    if q.dim() != 4 or k.dim() != 4:
        raise OpArgumentError(f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} must be 4-D [batch, heads, seq, "
                              "head_dim] (Hugging Face's layout after .transpose(1, 2))")
    B, _, S, D = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (B, S, D):
        raise OpArgumentError(f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, seq or head_dim; "
                              "only the head counts may differ")
    if D % 2:
        raise OpArgumentError(f"{op}: head_dim {D} is odd; the rotation pairs the features, so it must be even")
    if q.dtype != k.dtype:
        raise OpArgumentError(f"{op}: q is {q.dtype} but k is {k.dtype}; pass one dtype")
    if cos.dtype != sin.dtype:
        raise OpArgumentError(f"{op}: cos is {cos.dtype} but sin is {sin.dtype}; pass one dtype")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise OpArgumentError(f"{op}: {name} is on {t.device} but q is on {q.device}; pass all on one device")
    if cos.shape != sin.shape:
        raise OpArgumentError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    ok = (cos.dim() == 2 and tuple(cos.shape) == (S, D)) or (
        cos.dim() == 3 and cos.shape[0] in (1, B) and tuple(cos.shape[1:]) == (S, D))
    if not ok:
        raise OpArgumentError(f"{op}: cos/sin have shape {tuple(cos.shape)}; for q {tuple(q.shape)} they must be "
                              f"[{S}, {D}], [1, {S}, {D}] or [{B}, {S}, {D}] (the rotary embedding's output, before "
                              "unsqueezing a heads dimension)")
    if not isinstance(interleaved, bool):
        raise OpArgumentError(f"{op}: interleaved must be a bool, got {type(interleaved).__name__}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise OpArgumentError(f"{op}: cos/sin require grad, but the op treats them as constants (no gradient flows "
                              "to them); pass cos.detach() and sin.detach()")


def heads_view(t: torch.Tensor) -> torch.Tensor:
    """cos/sin ``[S, D]`` or ``[B, S, D]`` as ``[B or 1, 1, S, D]``, broadcasting over q's and k's heads."""
    return t.unsqueeze(0).unsqueeze(0) if t.dim() == 2 else t.unsqueeze(1)


def rope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """``(q_out, k_out)``: ``x * cos + rotate(x) * sin`` in the math dtype, rounded to x's dtype once."""
    acc = math_dtype(q.dtype)
    c, s = heads_view(cos).to(acc), heads_view(sin).to(acc)

    def apply(x):
        xf = x.to(acc)
        return (xf * c + rotate(xf, interleaved) * s).to(x.dtype)

    return apply(q), apply(k)


def rope_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  interleaved: bool):
    """``(dq, dk)``: ``dx = dy * cos - rotate(dy * sin)`` (the rotation's transpose is its negative)."""
    acc = math_dtype(grad_q.dtype)
    c, s = heads_view(cos).to(acc), heads_view(sin).to(acc)

    def apply(dy):
        g = dy.to(acc)
        return (g * c - rotate(g * s, interleaved)).to(dy.dtype)

    return apply(grad_q), apply(grad_k)


def make_rope(forward, backward):
    """Build an autograd-aware rope op from a forward and a backward kernel.

    ``forward(q, k, cos, sin, interleaved) -> (q_out, k_out)`` and ``backward(grad_q_out, grad_k_out, cos, sin,
    interleaved) -> (dq, dk)`` compute the reference's math (:func:`rope_forward`, :func:`rope_backward`); the
    gradients arrive as autograd hands them (any strides, possibly expanded). The returned
    ``rope(q, k, cos, sin, *, interleaved=False)`` checks its arguments and saves cos and sin (the backward needs
    nothing else); its ``unchecked`` attribute is the same without the check (for ``polyaccel.ops.rope``, which
    checks before resolving the builder).
    """

    class _Rope(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, cos, sin, interleaved):
            ctx.save_for_backward(cos, sin)
            ctx.interleaved = interleaved
            return forward(q, k, cos, sin, interleaved)

        @staticmethod
        def backward(ctx, grad_q, grad_k):
            cos, sin = ctx.saved_tensors
            dq, dk = backward(grad_q, grad_k, cos, sin, ctx.interleaved)
            return dq, dk, None, None, None

    def unchecked(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                  interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return _Rope.apply(q, k, cos, sin, interleaved)

    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
             interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        check_rope_args(q, k, cos, sin, interleaved)
        return _Rope.apply(q, k, cos, sin, interleaved)

    rope.unchecked = unchecked  # for polyaccel.ops.rope, which has checked the call already
    return rope


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
         interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k, `x * cos + rotate(x) * sin`; differentiable in q and k; returns `(q_out, k_out)`.

    Called as `fn(q, k, cos, sin, *, interleaved=False)`: `q` is `[B, Hq, S, D]` and `k` is
    `[B, Hk, S, D]` (Hugging Face's layout after `.transpose(1, 2)`; head counts may differ, D
    even), one dtype (fp32, bf16, fp16 or fp64), any strides. `cos` and `sin` are the rotary
    embedding's output, `[S, D]`, `[1, S, D]` or `[B, S, D]`, one floating dtype, broadcast
    over the heads; they are constants (no gradient; one that requires grad is refused). All on
    one device. `rotate` is Hugging Face's `rotate_half`, `cat(-x[..., D/2:], x[..., :D/2])`, or
    with `interleaved=True` each pair `(x[2i], x[2i+1])` becomes `(-x[2i+1], x[2i])`. Math in
    fp32 (fp64 for fp64 inputs), one rounding to the input dtype; the results have q's and
    k's shapes and dtype:

        out = x * cos + rotate(x) * sin
        dx  = dy * cos - rotate(dy * sin)          (the rotation's transpose is its negative)

    cos and sin are used as given (all D columns), so any table works, not only Hugging Face's
    duplicated halves. Build a builder's function with `make_rope(forward, backward)` (from
    `polyaccel.ops.reference.rope`): it supplies the argument checks and the autograd wiring.
    """
    check_rope_args(q, k, cos, sin, interleaved)
    return rope_forward(q, k, cos, sin, interleaved)  # plain torch ops: autograd differentiates them
