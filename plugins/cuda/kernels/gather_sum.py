"""Triton gather-sum: a MoE layer's combine (and its dispatch's backward) in one pass over the rows.

Done with torch ops, the combine gathers the T*k rows into token order (a copy), weights them
and sums over k (more passes), and its backward gathers ``grad_out`` per slot, multiplies by the
weights and runs a batched dot product for the weights' gradient. Here the forward reads each
row once and writes each token's sum once; the backward reads ``grad_out`` and (for the weights'
gradient) the rows once, and writes each row's gradient straight to its place: ``index`` is a
permutation, so every destination row has exactly one writer and no atomics are needed.

Math in fp32 (fp64 for fp64 inputs); 64-bit row offsets. :data:`gather_sum` is the
autograd-aware op built with the reference ``make_gather_sum``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from polyaccel.ops.reference.gather_sum import check_gather_sum_shapes, make_gather_sum

#: columns per program (the forward splits a row over programs; the backward loops over it)
MAX_BLOCK_H = 1024
NUM_WARPS = 4


@triton.jit
def _gather_sum_fwd_kernel(rows_ptr, index_ptr, w_ptr, out_ptr, H, K: tl.constexpr, HAS_W: tl.constexpr,
                           ACC: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=ACC)
    for j in tl.static_range(K):
        r = tl.load(index_ptr + t * K + j).to(tl.int64)
        v = tl.load(rows_ptr + r * H + cols, mask=mask, other=0.0).to(ACC)
        if HAS_W:
            v = v * tl.load(w_ptr + t * K + j).to(ACC)
        acc += v
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_sum_bwd_kernel(grad_ptr, rows_ptr, index_ptr, w_ptr, d_rows_ptr, d_w_ptr, H, K: tl.constexpr,
                           HAS_W: tl.constexpr, NEED_DW: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    span = tl.arange(0, BLOCK_H).to(tl.int64)
    for j in tl.static_range(K):
        r = tl.load(index_ptr + t * K + j).to(tl.int64)
        if HAS_W:
            scale = tl.load(w_ptr + t * K + j).to(ACC)
        dot = tl.zeros([BLOCK_H], dtype=ACC)
        for start in range(0, H, BLOCK_H):
            cols = start + span
            mask = cols < H
            g = tl.load(grad_ptr + t * H + cols, mask=mask, other=0.0).to(ACC)
            if HAS_W:
                tl.store(d_rows_ptr + r * H + cols, (g * scale).to(d_rows_ptr.dtype.element_ty), mask=mask)
            else:
                tl.store(d_rows_ptr + r * H + cols, g.to(d_rows_ptr.dtype.element_ty), mask=mask)
            if NEED_DW:
                dot += tl.load(rows_ptr + r * H + cols, mask=mask, other=0.0).to(ACC) * g
        if NEED_DW:
            tl.store(d_w_ptr + t * K + j, tl.sum(dot, axis=0).to(d_w_ptr.dtype.element_ty))


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _block(h: int) -> int:
    """Columns per program: the smallest power of 2 >= ``h``, at most :data:`MAX_BLOCK_H` (plain integers, as
    ``triton.next_power_of_2`` computes it, without a constexpr-function call on the host)."""
    return min(MAX_BLOCK_H, 1 << (max(h, 1) - 1).bit_length())


def gather_sum_forward(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * rows[index[t, j]]`` in one kernel."""
    T, k = index.shape
    H = rows.shape[1]
    out = rows.new_empty((T, H))
    if T and H:
        rows, index = rows.contiguous(), index.contiguous()
        w = weights.contiguous() if weights is not None else index  # an unused pointer when HAS_W is False
        block = _block(H)
        _gather_sum_fwd_kernel[(T, (H + block - 1) // block)](
            rows, index, w, out, H, K=k, HAS_W=weights is not None, ACC=_acc(rows.dtype), BLOCK_H=block,
            num_warps=NUM_WARPS)
    elif T:
        out.zero_()
    return out


def gather_sum_backward(grad_out: torch.Tensor, rows: torch.Tensor | None, index: torch.Tensor,
                        weights: torch.Tensor | None, need_d_weights: bool):
    """(d_rows, d_weights or None) in one kernel: one program per token, every slot of it."""
    T, k = index.shape
    H = grad_out.shape[1]
    d_rows = grad_out.new_empty((T * k, H))
    d_w = weights.new_empty(weights.shape) if need_d_weights else None  # (contiguous)
    if T and k:
        index = index.contiguous()
        w = weights.contiguous() if weights is not None else index
        src = rows.contiguous() if need_d_weights else grad_out
        _gather_sum_bwd_kernel[(T,)](
            grad_out, src, index, w, d_rows, d_w if d_w is not None else grad_out, H, K=k,
            HAS_W=weights is not None, NEED_DW=need_d_weights, ACC=_acc(grad_out.dtype), BLOCK_H=_block(H),
            num_warps=NUM_WARPS)
    return d_rows, d_w


#: the op: autograd-aware ``gather_sum(rows, index, weights=None)`` running the two kernels above
gather_sum = make_gather_sum(gather_sum_forward, gather_sum_backward, check=check_gather_sum_shapes)
