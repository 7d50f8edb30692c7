"""Reference Newton-Schulz orthogonalization and the Muon step (in place, one matrix at a time).

The momentum follows ``torch.optim.Muon`` exactly (an exponential average, written with the
same lerps), and so does the bfloat16 iteration: the update is rounded to bfloat16, scaled to
unit Frobenius norm there, iterated, and the transpose taken for tall matrices. float16 has a
narrower exponent than the update, so there the scaling happens *before* the cast (a large
gradient would otherwise overflow to inf); float32 and float64 iterate in their own dtype,
which is how the engines prove exactness in fp64.
"""

from __future__ import annotations

import math

import torch

from ...errors import OpArgumentError
from .optimizers import check_lists, upcast

#: the quintic iteration's coefficients (a, b, c): X <- a X + (b A + c A @ A) X with A = X X^T
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
LR_ADJUSTMENTS = ("original", "match_rms_adamw", "none")


def newton_schulz(x, *, steps=NS_STEPS, coefficients=NS_COEFFICIENTS, eps=NS_EPS, out=None):
    """The approximate orthogonal factor of each matrix in `x`, as a new tensor, or written into `out`. Returns it.

    `x` is a batch of matrices, shape ``(..., m, n)`` with at least 2 dims, in float64,
    float32, bfloat16 or float16; the result has `x`'s shape and dtype, and `x` is only
    read (but where `out` is `x`). `out` is None (a new, contiguous result) or a tensor of
    `x`'s shape, dtype and device with any strides that give no two elements one memory
    location, sharing no memory with `x` or being `x` itself (the same view: the result
    replaces `x`); the result's values are the same either way. Per matrix, with the
    iteration in `x`'s dtype (matrix products of 16-bit operands accumulate in fp32 and
    round each product to the dtype):

        X = x.mT if m > n else x                 # iterate on the wide orientation
        X = X / max(norm(X), eps)                # Frobenius norm; float16: computed in fp32 first
        repeat `steps` times:
            A = X @ X.mT
            B = b * A + c * A @ A
            X = a * X + B @ X                    # (a, b, c) = coefficients
        return X.mT if m > n else X

    `steps` is an int in [0, 100); `coefficients` three finite floats; `eps` > 0. The
    default coefficients are the quintic of ``torch.optim.Muon``; its singular values land
    in roughly [0.7, 1.2] rather than exactly 1, by design. A zero matrix stays zero; a
    matrix holding NaN or an infinity gives NaN in that matrix only.
    """
    if x.dim() < 2:
        raise OpArgumentError(f"newton_schulz: x must be a batch of matrices (..., m, n), got shape {tuple(x.shape)}")
    if x.numel() == 0:  # nothing to orthogonalize (and no batch size to infer for the flattening below)
        return torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    a, b, c = coefficients
    tall = x.shape[-2] > x.shape[-1]
    X = x.mT if tall else x
    if x.dtype == torch.float16:
        X32 = X.float()
        X = (X32 / _frobenius(X32).clamp(min=eps)).to(torch.float16)
    else:
        X = X / _frobenius(X).clamp(min=eps)
    batch = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:]) if X.dim() > 3 else X
    mm = torch.addmm if X.dim() == 2 else torch.baddbmm  # one fused product-and-sum, as torch.optim.Muon
    for _ in range(steps):
        A = X @ X.mT
        B = mm(A, A, A, beta=b, alpha=c)
        X = mm(X, B, X, beta=a)
    X = X.reshape(*batch, *X.shape[-2:])
    if out is not None:
        return out.copy_(X.mT if tall else X)
    return (X.mT if tall else X).contiguous()


def _frobenius(X: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)


def muon_lr_scale(shape, adjustment: str) -> float:
    """The factor on ``lr`` for one orthogonalized ``(m, n)`` block (``torch.optim.Muon``'s ``adjust_lr_fn``)."""
    m, n = shape[-2], shape[-1]
    if adjustment == "original":
        return math.sqrt(max(1.0, m / n))
    if adjustment == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    return 1.0


def split_heads(t: torch.Tensor, split) -> torch.Tensor:
    """``t`` (m, n) as a batch of head blocks: ``split=(0, h)`` -> (h, m/h, n), ``(1, h)`` -> (h, m, n/h)."""
    if split is None:
        return t
    dim, heads = split
    m, n = t.shape
    if dim == 0:
        return t.reshape(heads, m // heads, n)
    return t.reshape(m, heads, n // heads).transpose(0, 1)


def join_heads(blocks: torch.Tensor, split, shape) -> torch.Tensor:
    """The inverse of :func:`split_heads`."""
    if split is None:
        return blocks
    dim, _ = split
    if dim == 0:
        return blocks.reshape(shape)
    return blocks.transpose(0, 1).reshape(shape)


def check_split(name: str, i: int, shape, split) -> None:
    if split is None:
        return
    ok = isinstance(split, (tuple, list)) and len(split) == 2 and split[0] in (0, 1) \
        and isinstance(split[1], int) and split[1] >= 1 and len(shape) == 2 and shape[split[0]] % split[1] == 0
    if not ok:
        raise OpArgumentError(f"{name}: head split {split!r} of tensor {i} (shape {tuple(shape)}) must be (dim, heads) "
                              "with dim 0 or 1 and heads dividing that dim")


def ns_input(blocks: torch.Tensor, ns_dtype: torch.dtype, eps: float = NS_EPS) -> torch.Tensor:
    """``blocks`` in the iteration's dtype: a plain cast, except that float16 (whose range a large update
    overflows) gets the blocks scaled to unit Frobenius norm in fp32 first; :func:`newton_schulz` then
    scales the rounded blocks again (by a norm within rounding of 1)."""
    if ns_dtype != torch.float16 or blocks.dtype == torch.float16:
        return blocks.to(ns_dtype)
    b32 = blocks.float()
    return (b32 / _frobenius(b32).clamp(min=eps)).to(torch.float16)


def orthogonalized_update(update: torch.Tensor, *, split=None, ns_dtype=torch.bfloat16, ns_steps=NS_STEPS,
                          ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS) -> torch.Tensor:
    """Newton-Schulz of one (m, n) update, whole or per head block, in ``ns_dtype``; back in ``update``'s dtype."""
    blocks = ns_input(split_heads(update, split), ns_dtype, eps)
    out = newton_schulz(blocks, steps=ns_steps, coefficients=ns_coefficients, eps=eps)
    return join_heads(out, split, update.shape).to(update.dtype)


def fused_muon(params, grads, momentum_buffers, *, lr, momentum, weight_decay, nesterov=True,
               ns_steps=NS_STEPS, ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS, ns_dtype=torch.bfloat16,
               lr_adjustment="original", head_splits=None):
    """One Muon step over lists of 2-D tensors, in place. Returns None.

    `params`, `grads` and `momentum_buffers` are equally long lists of 2-D tensors on one
    device, element-wise equal in shape (the buffers may be fp32 for 16-bit params); every
    other argument is keyword-only. Per tensor, in fp32 for 16-bit tensors and in the
    tensor's own dtype otherwise:

        buf = buf + (1 - momentum) * (g - buf)           # = momentum * buf + (1 - momentum) * g
        u = g + momentum * (buf - g) if nesterov else buf
        O = newton_schulz(u.to(ns_dtype), steps=ns_steps, coefficients=ns_coefficients, eps=eps)
        p = p * (1 - lr * weight_decay)                  # decoupled
        p = p - lr * scale * O

    computed as ``torch.optim.Muon`` computes it (the same lerps; for float16 `ns_dtype` the
    scaling to unit norm happens before the cast). `ns_dtype` is bfloat16 (the default, as
    torch), float16, float32 or float64. ``scale`` is `lr_adjustment` of the block's shape
    ``(m, n)``: "original" sqrt(max(1, m/n)), "match_rms_adamw" 0.2*sqrt(max(m, n)), "none" 1.

    `head_splits` (None, or one entry per tensor: None or ``(dim, heads)``) orthogonalizes a
    tensor per head: ``(0, h)`` cuts its rows into h equal blocks (q/k/v projections),
    ``(1, h)`` its columns (the output projection); each block is one matrix of the
    iteration and gets its own scale. `p` and `buf` are written back (rounded to their
    dtypes); `grads` are only read; zero-size tensors are left alone.

    Hyperparameters: finite ``lr >= 0``, ``weight_decay >= 0``, momentum in [0, 1),
    ns_steps an int in [0, 100), eps > 0. A non-finite gradient makes that tensor's
    buffer and parameter non-finite (NaN or an infinity, which unspecified).
    """
    check_lists("fused_muon", params, grads, momentum_buffers)
    if head_splits is not None and len(head_splits) != len(params):
        raise OpArgumentError(f"fused_muon: head_splits has {len(head_splits)} entries for {len(params)} tensors")
    for i, p in enumerate(params):
        if p.dim() != 2:
            raise OpArgumentError(f"fused_muon: tensor {i} has shape {tuple(p.shape)}; Muon steps 2-D matrices only "
                                  "(step other parameters with Adam, as MuonWithAuxAdam does)")
        check_split("fused_muon", i, p.shape, None if head_splits is None else head_splits[i])
    if lr_adjustment not in LR_ADJUSTMENTS:
        raise OpArgumentError(f"fused_muon: lr_adjustment={lr_adjustment!r} is not one of {LR_ADJUSTMENTS}")
    for i, (p, g, buf) in enumerate(zip(params, grads, momentum_buffers, strict=True)):
        if p.numel() == 0:
            continue
        split = None if head_splits is None else head_splits[i]
        p32, g32, b32 = upcast(p), upcast(g), upcast(buf)
        b32.lerp_(g32, 1 - momentum)
        u = g32.lerp(b32, momentum) if nesterov else b32
        ortho = orthogonalized_update(u, split=split, ns_dtype=ns_dtype, ns_steps=ns_steps,
                                      ns_coefficients=ns_coefficients, eps=eps)
        blk = split_heads(p32, split).shape
        scale = muon_lr_scale(blk, lr_adjustment)
        p32.mul_(1 - lr * weight_decay).add_(ortho, alpha=-lr * scale)
        if buf is not b32:
            buf.copy_(b32)
        if p is not p32:
            p.copy_(p32)
