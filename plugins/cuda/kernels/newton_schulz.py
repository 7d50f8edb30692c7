"""Newton-Schulz orthogonalization as Triton GEMMs (bf16/fp16 operands, fp32 accumulation), and Muon on top.

Per matrix of the batch, in the wide orientation (a tall matrix as its transposed view, read and
written column-major), the iteration of ``polyaccel.ops.reference.newton_schulz`` is three launches:

1. ``A = X @ X^T`` (:func:`_gram_kernel`): A is symmetric, so only the tiles on and above the
   diagonal are computed; each off-diagonal tile is stored twice (as itself and transposed).
2. ``B = b A + c A @ A`` (:func:`_poly_kernel`): ``A @ A`` is symmetric too, so again only the
   upper tiles; both operands are read as rows of A (``A[:, j] = A[j, :]^T``), the ``b A`` term is
   the epilogue.
3. ``X' = a X + B @ X`` (:func:`_update_kernel`): a plain GEMM with the ``a X`` epilogue.

So an ``m x n`` matrix (m <= n) costs about ``m^2 n / 2 + m^3 / 2 + m^2 n`` multiply-adds per
iteration instead of ``2 m^2 n + m^3``: the two symmetric products do half the work of a full GEMM.
Every product is rounded to the iteration dtype when stored, as the reference rounds each
``torch.matmul`` result, and the batch is the grid's second axis (one launch for all matrices).
The scaling to unit Frobenius norm is one reduction (``torch.linalg.vector_norm`` in fp32) and
one scaling pass. A tall batch is iterated as its transposed view, in its own memory layout (the
kernels take the strides): no transposing copy in or out.

Inputs in float32 or float64 iterate in their own dtype through the reference (cuBLAS): Triton's
fp32 dot would use TF32 or a slow path, and those dtypes are there for exactness, not speed.

:func:`fused_muon` is the op ``fused_muon`` for the cuda plugin: the momentum and the update as
torch ops around this Newton-Schulz (one batched call per group of equal block shapes).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from polyaccel.ops.reference import muon as ref
from polyaccel.ops.reference.optimizers import upcast

from ..triton_support import interpreting

#: iteration dtypes the Triton path serves; others go to the reference
TRITON_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TileConfig:
    """Square BM x BM tiles for the symmetric products, BM x BN for the update; BK the reduction step."""

    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def default_config(m: int, n: int) -> TileConfig:
    """Hopper-class tiles: 128-wide for large matrices (the update's 256 columns: 1.09-1.17x the 128 x 128 tile on
    every ZeRO batch of the 220M and 1B Llama, square, tall and wide; one H100 call, benchmarks/RESULTS.md), smaller
    for small ones (more programs)."""
    if m >= 1024 and n >= 1024:
        return TileConfig(128, 256, 64, 8, 4)
    if m >= 256:
        return TileConfig(64, 128, 64, 4, 4)
    return TileConfig(32, 64, 32, 4, 3)


def _upcast() -> bool:
    """The interpreter multiplies bf16 as raw integers: upcast the (exact) operands to fp32 there."""
    return interpreting()


@triton.jit
def _triangle(pid, T):
    """The (i, j) tile, i <= j, of the ``pid``-th upper-triangular tile of a T x T grid (row-major)."""
    # row i starts at i*T - i*(i-1)/2; invert with a float sqrt, then correct by one either way
    pf = pid.to(tl.float32)
    tf = T.to(tl.float32)
    i = ((2 * tf + 1 - tl.sqrt((2 * tf + 1) * (2 * tf + 1) - 8 * pf)) / 2).to(tl.int32)
    i = tl.maximum(tl.minimum(i, T - 1), 0)
    start = i * T - (i * (i - 1)) // 2
    i = tl.where(pid < start, i - 1, i)
    start = i * T - (i * (i - 1)) // 2
    nxt = (i + 1) * T - ((i + 1) * i) // 2
    i = tl.where(pid >= nxt, i + 1, i)
    start = i * T - (i * (i - 1)) // 2
    j = i + (pid - start)
    return i, j


@triton.jit
def _gram_kernel(x_ptr, a_ptr, M, K, s_xb, s_xm, s_xk, s_ab, s_am, s_an,
                 BM: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    """A[b] = X[b] @ X[b]^T, upper tiles computed, mirrored below the diagonal."""
    pid = tl.program_id(0)
    bat = tl.program_id(1).to(tl.int64)
    T = tl.cdiv(M, BM)
    i, j = _triangle(pid, T)
    ri = (i * BM + tl.arange(0, BM)).to(tl.int64)
    rj = (j * BM + tl.arange(0, BM)).to(tl.int64)
    ks = tl.arange(0, BK)
    xb = x_ptr + bat * s_xb
    pi = xb + ri[:, None] * s_xm + ks[None, :] * s_xk
    pj = xb + rj[None, :] * s_xm + ks[:, None] * s_xk  # X[j rows, k]^T: a (BK, BM) tile
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k in range(0, K, BK):
        k_ok = (k + ks) < K
        u = tl.load(pi, mask=(ri[:, None] < M) & k_ok[None, :], other=0.0)
        v = tl.load(pj, mask=(rj[None, :] < M) & k_ok[:, None], other=0.0)
        if UPCAST:
            u = u.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(u, v, acc)
        pi += BK * s_xk
        pj += BK * s_xk
    out = acc.to(a_ptr.dtype.element_ty)
    ab = a_ptr + bat * s_ab
    mask = (ri[:, None] < M) & (rj[None, :] < M)
    tl.store(ab + ri[:, None] * s_am + rj[None, :] * s_an, out, mask=mask)
    if i != j:
        tl.store(ab + rj[None, :] * s_am + ri[:, None] * s_an, out, mask=mask)


@triton.jit
def _poly_kernel(a_ptr, b_ptr, M, coef_b, coef_c, s_ab, s_am, s_an, s_bb, s_bm, s_bn,
                 BM: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    """B[b] = coef_b * A[b] + coef_c * A[b] @ A[b] for a symmetric A: upper tiles, mirrored."""
    pid = tl.program_id(0)
    bat = tl.program_id(1).to(tl.int64)
    T = tl.cdiv(M, BM)
    i, j = _triangle(pid, T)
    ri = (i * BM + tl.arange(0, BM)).to(tl.int64)
    rj = (j * BM + tl.arange(0, BM)).to(tl.int64)
    ks = tl.arange(0, BK)
    ab = a_ptr + bat * s_ab
    pi = ab + ri[:, None] * s_am + ks[None, :] * s_an
    pj = ab + rj[None, :] * s_am + ks[:, None] * s_an  # A[k, j] read as A[j, k]: rows of A
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k in range(0, M, BK):
        k_ok = (k + ks) < M
        u = tl.load(pi, mask=(ri[:, None] < M) & k_ok[None, :], other=0.0)
        v = tl.load(pj, mask=(rj[None, :] < M) & k_ok[:, None], other=0.0)
        if UPCAST:
            u = u.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(u, v, acc)
        pi += BK * s_an
        pj += BK * s_an
    mask = (ri[:, None] < M) & (rj[None, :] < M)
    a_ij = tl.load(ab + ri[:, None] * s_am + rj[None, :] * s_an, mask=mask, other=0.0).to(tl.float32)
    out = (coef_b * a_ij + coef_c * acc).to(b_ptr.dtype.element_ty)
    bb = b_ptr + bat * s_bb
    tl.store(bb + ri[:, None] * s_bm + rj[None, :] * s_bn, out, mask=mask)
    if i != j:
        tl.store(bb + rj[None, :] * s_bm + ri[:, None] * s_bn, out, mask=mask)


@triton.jit
def _update_kernel(b_ptr, x_ptr, y_ptr, M, N, coef_a, s_bb, s_bm, s_bk, s_xb, s_xm, s_xn, s_yb, s_ym, s_yn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   UPCAST: tl.constexpr):
    """Y[b] = coef_a * X[b] + B[b] @ X[b] (B is M x M, X and Y M x N); grouped tile order for L2 reuse."""
    pid = tl.program_id(0)
    bat = tl.program_id(1).to(tl.int64)
    tm = tl.cdiv(M, BM)
    tn = tl.cdiv(N, BN)
    per_group = GROUP_M * tn
    g = pid // per_group
    first = g * GROUP_M
    size = tl.minimum(tm - first, GROUP_M)
    pm = first + (pid % per_group) % size
    pn = (pid % per_group) // size
    rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pn * BN + tl.arange(0, BN)).to(tl.int64)
    ks = tl.arange(0, BK)
    bb = b_ptr + bat * s_bb
    xb = x_ptr + bat * s_xb
    pb = bb + rm[:, None] * s_bm + ks[None, :] * s_bk
    px = xb + ks[:, None] * s_xm + rn[None, :] * s_xn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, M, BK):
        k_ok = (k + ks) < M
        u = tl.load(pb, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
        v = tl.load(px, mask=k_ok[:, None] & (rn[None, :] < N), other=0.0)
        if UPCAST:
            u = u.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(u, v, acc)
        pb += BK * s_bk
        px += BK * s_xm
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x_mn = tl.load(xb + rm[:, None] * s_xm + rn[None, :] * s_xn, mask=mask, other=0.0).to(tl.float32)
    out = (coef_a * x_mn + acc).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + bat * s_yb + rm[:, None] * s_ym + rn[None, :] * s_yn, out, mask=mask)


def _scaled_wide(x: torch.Tensor, eps: float, into: torch.Tensor | None = None) -> torch.Tensor:
    """x (batch, m, n), m <= n, scaled to unit Frobenius norm per matrix, in x's dtype: into ``into`` (any
    strides; it may be x itself), else a new tensor in x's memory layout where x's is dense (a tall batch's
    transposed view stays column-major: the kernels take any strides, so the iteration needs no transposing
    copy), contiguous otherwise.

    float16 scales in fp32 before the cast (as the reference), bf16 scales in its own dtype (the
    reference's rounding: the norm is rounded to bf16 first).
    """
    if x.dtype == torch.float16:
        x32 = x.float()
        norm = torch.linalg.vector_norm(x32, dim=(-2, -1), keepdim=True).clamp_(min=eps)
        if into is not None:
            return torch.div(x32, norm, out=into)  # computed in fp32, rounded once to fp16 as it is stored
        return (x32 / norm).to(torch.float16)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_(min=eps)
    return torch.div(x, norm) if into is None else torch.div(x, norm, out=into)


def newton_schulz_batched(x: torch.Tensor, *, steps: int, coefficients, eps: float,
                          config: TileConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The iteration on a (batch, m, n) bf16/fp16 tensor with m <= n. Returns a new (batch, m, n) tensor, in x's
    memory layout where that is dense (row-major, or column-major for the transposed view of a tall batch), or
    ``out`` (any strides; it may be x itself) with the result written into it: the iteration alternates between
    ``out`` and one scratch batch so that its last step writes ``out`` (no copy after it)."""
    a, b, c = (float(v) for v in coefficients)
    batch, m, n = x.shape
    X = _scaled_wide(x, eps, into=out if out is not None and steps % 2 == 0 else None)
    if steps == 0 or X.numel() == 0:
        return X
    cfg = config or default_config(m, n)
    up = _upcast()
    A = torch.empty((batch, m, m), dtype=X.dtype, device=X.device)
    B = torch.empty_like(A)
    Y = out if out is not None and X is not out else torch.empty_like(X)  # X's strides (a dense X)
    t = triton.cdiv(m, cfg.bm)
    tri = (t * (t + 1) // 2, batch)
    upd = (triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn), batch)
    for _ in range(steps):
        _gram_kernel[tri](X, A, m, n, *X.stride(), *A.stride(), BM=cfg.bm, BK=cfg.bk, UPCAST=up,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        _poly_kernel[tri](A, B, m, b, c, *A.stride(), *B.stride(), BM=cfg.bm, BK=cfg.bk, UPCAST=up,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        _update_kernel[upd](B, X, Y, m, n, a, *B.stride(), *X.stride(), *Y.stride(), BM=cfg.bm, BN=cfg.bn,
                            BK=cfg.bk, GROUP_M=cfg.group_m, UPCAST=up, num_warps=cfg.num_warps,
                            num_stages=cfg.num_stages)
        X, Y = Y, X
    return X


def newton_schulz(x: torch.Tensor, *, steps=ref.NS_STEPS, coefficients=ref.NS_COEFFICIENTS, eps=ref.NS_EPS,
                  out: torch.Tensor | None = None, config: TileConfig | None = None) -> torch.Tensor:
    """The op ``newton_schulz``: bf16/fp16 batches through the Triton iteration, other dtypes the reference. With
    ``out``, the last step writes it directly where its wide orientation is one strided batch (any strides), else
    the result is copied into it."""
    if x.dtype not in TRITON_DTYPES or x.numel() == 0:
        return ref.newton_schulz(x, steps=steps, coefficients=coefficients, eps=eps, out=out)
    tall = x.shape[-2] > x.shape[-1]
    X = x.mT if tall else x
    lead, shape = X.shape[:-2], X.shape[-2:]
    into = None
    if out is not None:
        wide_out = out.mT if tall else out
        try:
            into = wide_out.view(-1, *shape)
        except RuntimeError:  # no single batch stride: iterate apart, one copy into out
            into = None
    res = newton_schulz_batched(X.reshape(-1, *shape), steps=steps, coefficients=coefficients, eps=eps,
                                config=config, out=into)
    if out is not None:
        if into is None:
            (out.mT if tall else out).copy_(res.view(*lead, *shape))
        return out
    res = res.reshape(*lead, *shape)
    return (res.mT if tall else res).contiguous()


def fused_muon(params, grads, momentum_buffers, *, lr, momentum, weight_decay, nesterov=True,
               ns_steps=ref.NS_STEPS, ns_coefficients=ref.NS_COEFFICIENTS, eps=ref.NS_EPS,
               ns_dtype=torch.bfloat16, lr_adjustment="original", head_splits=None):
    """The op ``fused_muon``: torch momentum and update around the Triton Newton-Schulz.

    The orthogonalized updates of all tensors whose (head) blocks share one shape go through one
    batched Newton-Schulz call; the arithmetic per tensor is the reference's.
    """
    if ns_dtype not in TRITON_DTYPES:
        return ref.fused_muon(params, grads, momentum_buffers, lr=lr, momentum=momentum,
                              weight_decay=weight_decay, nesterov=nesterov, ns_steps=ns_steps,
                              ns_coefficients=ns_coefficients, eps=eps, ns_dtype=ns_dtype,
                              lr_adjustment=lr_adjustment, head_splits=head_splits)
    ref.check_lists("fused_muon", params, grads, momentum_buffers)
    work = []  # (index, p32, blocks in the wide orientation, split)
    by_shape = defaultdict(list)
    for i, (p, g, buf) in enumerate(zip(params, grads, momentum_buffers, strict=True)):
        if p.numel() == 0:
            continue
        split = None if head_splits is None else head_splits[i]
        g32, b32 = upcast(g), upcast(buf)
        b32.lerp_(g32, 1 - momentum)
        u = g32.lerp(b32, momentum) if nesterov else b32
        if buf is not b32:
            buf.copy_(b32)
        blocks = ref.split_heads(u, split)
        blocks = blocks if blocks.dim() == 3 else blocks.unsqueeze(0)
        tall = blocks.shape[-2] > blocks.shape[-1]
        wide = ref.ns_input(blocks.mT if tall else blocks, ns_dtype, eps)
        by_shape[(tuple(wide.shape[-2:]), wide.dtype)].append(len(work))
        work.append((i, wide, split, tall))
    results = [None] * len(work)
    for (_, _), idx in by_shape.items():
        stacked = torch.cat([work[k][1] for k in idx]) if len(idx) > 1 else work[idx[0]][1]
        out = newton_schulz_batched(stacked, steps=ns_steps, coefficients=ns_coefficients, eps=eps)
        start = 0
        for k in idx:
            cnt = work[k][1].shape[0]
            results[k] = out[start:start + cnt]
            start += cnt
    for (i, _, split, tall), ortho in zip(work, results, strict=True):
        p = params[i]
        ortho = ortho.mT if tall else ortho
        ortho = ref.join_heads(ortho if split is not None else ortho[0], split, p.shape)
        p32 = upcast(p)
        blk = ref.split_heads(p32, split).shape
        scale = ref.muon_lr_scale(blk, lr_adjustment)
        p32.mul_(1 - lr * weight_decay).add_(ortho.to(p32.dtype), alpha=-lr * scale)
        if p is not p32:
            p.copy_(p32)


__all__ = ["TileConfig", "default_config", "fused_muon", "newton_schulz", "newton_schulz_batched"]
