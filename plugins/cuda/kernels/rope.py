"""Triton RoPE: q and k rotated in one launch, forward and backward by one kernel.

One program per token ``(b, s)``: it loads that position's cos/sin row once and rotates every
head of q and then of k, a ``[BLOCK_H, D/2]`` tile of pairs at a time (the two halves, or the even
and odd features when interleaved). Math in fp32 (fp64 for fp64 inputs), one rounding to the
input dtype. The backward is the same kernel with the transposed rotation
(``dx1 = dy1 c1 + dy2 s2``, ``dx2 = dy2 c2 - dy1 s1``), so it needs only cos and sin.

Every tensor is read through its own four strides (cos/sin through three, a broadcast batch with
stride 0): q and k as Hugging Face hands them (``[B, S, H, D]`` projections viewed as
``[B, H, S, D]``) are read in place, and outputs are allocated in the input's memory order.
:data:`rope` is the autograd-aware op built with the reference's ``make_rope``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from polyaccel.ops.reference.rope import make_rope

#: pairs of one head are BLOCK_D wide; heads per step keep a tile at most this many pairs: 8 a thread at 4 warps.
#: At Llama-3-8B's shapes (32 + 8 heads of 64 pairs) 16 heads a step ran 1.5% faster than 32 on an H100
#: (model_kernels_gpu.py --tune, RESULTS.md); more heads take more steps
MAX_TILE = 1024


@triton.jit
def _rotate_heads(x_ptr, o_ptr, b, s, n_heads, xs_b, xs_h, xs_s, xs_d, os_b, os_h, os_s, os_d, i1, i2, dmask,
                  c1, c2, s1, s2, BACKWARD: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr):
    x_tok = x_ptr + b * xs_b + s * xs_s
    o_tok = o_ptr + b * os_b + s * os_s
    for h0 in range(0, n_heads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        mask = (h < n_heads)[:, None] & dmask[None, :]
        xh = x_tok + h[:, None] * xs_h
        oh = o_tok + h[:, None] * os_h
        x1 = tl.load(xh + i1[None, :] * xs_d, mask=mask, other=0.0).to(ACC)
        x2 = tl.load(xh + i2[None, :] * xs_d, mask=mask, other=0.0).to(ACC)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(oh + i1[None, :] * os_d, y1.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(oh + i2[None, :] * os_d, y2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, S, HALF, n_qh, n_kh,
                 qs_b, qs_h, qs_s, qs_d, ks_b, ks_h, ks_s, ks_d,
                 qos_b, qos_h, qos_s, qos_d, kos_b, kos_h, kos_s, kos_d,
                 cs_b, cs_s, cs_d, ss_b, ss_s, ss_d,
                 INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, ACC: tl.constexpr, BLOCK_HQ: tl.constexpr,
                 BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    b = tok // S
    s = tok % S
    j = tl.arange(0, BLOCK_D).to(tl.int64)
    dmask = j < HALF
    if INTERLEAVED:
        i1 = 2 * j
        i2 = 2 * j + 1
    else:
        i1 = j
        i2 = j + HALF
    c_row = cos_ptr + b * cs_b + s * cs_s
    s_row = sin_ptr + b * ss_b + s * ss_s
    c1 = tl.load(c_row + i1 * cs_d, mask=dmask, other=0.0).to(ACC)[None, :]
    c2 = tl.load(c_row + i2 * cs_d, mask=dmask, other=0.0).to(ACC)[None, :]
    s1 = tl.load(s_row + i1 * ss_d, mask=dmask, other=0.0).to(ACC)[None, :]
    s2 = tl.load(s_row + i2 * ss_d, mask=dmask, other=0.0).to(ACC)[None, :]
    _rotate_heads(q_ptr, qo_ptr, b, s, n_qh, qs_b, qs_h, qs_s, qs_d, qos_b, qos_h, qos_s, qos_d, i1, i2, dmask,
                  c1, c2, s1, s2, BACKWARD, ACC, BLOCK_HQ)
    _rotate_heads(k_ptr, ko_ptr, b, s, n_kh, ks_b, ks_h, ks_s, ks_d, kos_b, kos_h, kos_s, kos_d, i1, i2, dmask,
                  c1, c2, s1, s2, BACKWARD, ACC, BLOCK_HK)


def _table_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, seq, feature) strides of cos/sin ``[S, D]`` (batch 0), ``[1, S, D]`` (batch 0) or ``[B, S, D]``."""
    if t.dim() == 2:
        return 0, t.stride(0), t.stride(1)
    return (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1), t.stride(2)


def _like(t: torch.Tensor) -> torch.Tensor:
    """An output in ``t``'s memory order (dense layouts keep their strides; others become contiguous)."""
    return torch.empty_like(t)


def _launch(q, k, cos, sin, interleaved: bool, backward: bool, *, block_hq: int | None = None,
            block_hk: int | None = None, num_warps: int = 4):
    qo, ko = _like(q), _like(k)
    B, n_qh, S, D = q.shape
    n_kh = k.shape[1]
    if B * S == 0 or D == 0:
        return qo, ko
    half = D // 2
    block_d = triton.next_power_of_2(half)
    # one head tile for q and k (k's GQA heads padded to q's): k's own smaller tile halves each thread's vector
    # width and measured ~6% slower on an H100 (RESULTS.md); the padded heads are masked, never read
    shared = min(triton.next_power_of_2(max(n_qh, n_kh, 1)), max(1, MAX_TILE // block_d))
    block_hq, block_hk = block_hq or shared, block_hk or shared
    acc = tl.float64 if q.dtype == torch.float64 else tl.float32
    _rope_kernel[(B * S,)](q, k, cos, sin, qo, ko, S, half, n_qh, n_kh, *q.stride(), *k.stride(), *qo.stride(),
                           *ko.stride(), *_table_strides(cos), *_table_strides(sin), INTERLEAVED=interleaved,
                           BACKWARD=backward, ACC=acc, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d,
                           num_warps=num_warps)
    return qo, ko


def rope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, **kw):
    """``(q_out, k_out)`` in one launch, each in its input's memory order (arguments as the contract allows: the
    op checks them, :data:`rope`)."""
    return _launch(q, k, cos, sin, interleaved, False, **kw)


def rope_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  interleaved: bool, **kw):
    """``(dq, dk)`` in one launch: the transposed rotation of the incoming gradients (any strides)."""
    return _launch(grad_q, grad_k, cos, sin, interleaved, True, **kw)


#: the op: autograd-aware ``rope(q, k, cos, sin, *, interleaved=False)`` running the kernel above
rope = make_rope(rope_forward, rope_backward)
