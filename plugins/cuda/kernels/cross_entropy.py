"""Triton chunk kernels of ``linear_cross_entropy``: the logits chunk's statistics and its gradient in place.

The op is core's chunked loop (:mod:`polyaccel.ops.chunked_loss`): per chunk of tokens, cuBLAS
computes the logits ``[rows, V_local]`` in the input dtype, these kernels do the rest of the
chunk's math, and cuBLAS spends the gradient (``dz @ W``, ``dz.T @ h``). Two kernels:

* :func:`stats`: one program per row, an online logsumexp over the row in blocks of columns (fp32
  math, fp64 for fp64 input; one exp an element) and the target column's logit: one read of the chunk;
* :func:`grad_`: ``dz = coef * exp(z - lse) - scale * onehot(target)`` written over the logits
  chunk (same dtype, same memory): one read and one write, a 2-D grid over rows and column blocks.

Without a vocab-parallel group the two run as one (:func:`stats_grad_`): a program per row makes
the statistics pass and then the gradient pass over the same row. At :data:`FUSED_WARPS` warps a
program fills an SM, so the rows in flight fit in L2 and the second read of a row costs no
HBM traffic: two passes over the chunk instead of three. An ignored row's gradient is written as
zeros without reading the row, and the target column is corrected once after the gradient pass
rather than tested at every element. The backward's scaling by the loss's
incoming gradient (:func:`scale_`) reads that scalar on the device and returns at once when it
is exactly 1 (``loss.backward()``), without a host read.

Compared with torch's chunk math (an fp32 copy of the chunk, logsumexp's temporaries, the
exp and scatter passes), the chunk needs no memory beyond its logits and three passes instead
of about eight. 64-bit row offsets: a chunk may pass 2**31 elements (a row may not).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from polyaccel.ops.chunked_loss import make_linear_cross_entropy

#: columns per step of a row (stats) and per program (grad)
BLOCK_V = 4096
NUM_WARPS = 8
#: the fused kernel's columns per step and warps (one program an SM: its rows stay in L2 between the passes;
#: one H100 call, vocab 128256: 7.5 ms a Llama-3-8B loss at 32768 columns, 8.1 at 16384, 9.1 at 8192)
FUSED_BLOCK = 32768
FUSED_WARPS = 32
#: elements per program of the backward's scaling
SCALE_BLOCK = 8192


@triton.jit
def _row_logsumexp(base, V, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """Online logsumexp of one row (``base``: its first element), a block of columns a step: one exp an element
    (the running max and sum are scalars, rescaled once a block). Column offsets in 32 bits."""
    cols = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), ACC)
    total = tl.zeros((), ACC)
    for start in range(0, V, BLOCK):
        offs = start + cols
        z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, tl.max(z, 0))
        # a row still all -inf so far contributes nothing: exp(-inf - -inf) would be NaN
        total = tl.where(m_new == float("-inf"), 0.0, total * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0))
        m = m_new
    return m + tl.log(total)


@triton.jit
def _stats_kernel(z_ptr, target_ptr, lse_ptr, picked_ptr, V, stride, ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    lse = _row_logsumexp(base, V, ACC, BLOCK)
    tl.store(lse_ptr + row, lse)
    t = tl.load(target_ptr + row)
    picked = tl.load(base + tl.maximum(t, 0)).to(ACC)
    tl.store(picked_ptr + row, tl.where(t >= 0, picked, 0.0))


@triton.jit
def _grad_kernel(z_ptr, lse_ptr, target_ptr, coef_ptr, scale_ptr, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # columns (V < 2**31) in 32 bits, the row in 64
    mask = offs < V
    ptrs = z_ptr + row * stride + offs
    lse = tl.load(lse_ptr + row)
    z = tl.load(ptrs, mask=mask, other=0.0).to(lse.dtype)
    dz = tl.load(coef_ptr + row) * tl.exp(z - lse)
    dz = tl.where(offs == tl.load(target_ptr + row), dz - tl.load(scale_ptr + row), dz)
    tl.store(ptrs, dz.to(z_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stats_grad_kernel(z_ptr, target_ptr, scale_ptr, loss_ptr, V, stride, z_loss,
                       ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride  # 64-bit row offset; the columns (V < 2**31) in 32 bits
    cols = tl.arange(0, BLOCK)
    t = tl.load(target_ptr + row)
    if t < 0:  # without a group, target -1 is an ignored row: a zero gradient, written without reading the row
        tl.store(loss_ptr + row, 0.0)
        for start in range(0, V, BLOCK):
            offs = start + cols
            tl.store(base + offs, tl.zeros((BLOCK,), z_ptr.dtype.element_ty), mask=offs < V)
    else:
        lse = _row_logsumexp(base, V, ACC, BLOCK)
        picked = tl.load(base + t).to(ACC)
        tl.store(loss_ptr + row, lse - picked + z_loss * lse * lse)
        scale = tl.load(scale_ptr + row).to(ACC)
        coef = scale * (1.0 + 2.0 * z_loss * lse)
        for start in range(0, V, BLOCK):
            offs = start + cols
            mask = offs < V
            z = tl.load(base + offs, mask=mask, other=0.0).to(ACC)
            tl.store(base + offs, (coef * tl.exp(z - lse)).to(z_ptr.dtype.element_ty), mask=mask)
        # the target column once, from its logit in the math dtype (subtracting after the rounding to z's dtype
        # would cancel most of its bits as the softmax nears 1); after the loop's stores, hence the barrier
        tl.debug_barrier()
        tl.store(base + t, (coef * tl.exp(picked - lse) - scale).to(z_ptr.dtype.element_ty))


@triton.jit
def _scale_kernel(g_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    factor = tl.load(factor_ptr)
    if factor != 1.0:  # loss.backward() hands exactly 1: nothing to do, and no host read to find that out
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask)
        tl.store(g_ptr + offs, (g.to(factor.dtype) * factor).to(g_ptr.dtype.element_ty), mask=mask)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class TritonChunkKernels:
    """The chunk math of :mod:`polyaccel.ops.chunked_loss` in the two kernels above."""

    @staticmethod
    def stats(z: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, v = z.shape
        acc = _math_dtype(z.dtype)
        lse = torch.empty(rows, dtype=acc, device=z.device)
        picked = torch.empty(rows, dtype=acc, device=z.device)
        if rows:
            z = z if z.stride(1) == 1 else z.contiguous()
            _stats_kernel[(rows,)](z, target.contiguous(), lse, picked, v, z.stride(0), ACC=_acc(z.dtype),
                                   BLOCK=min(BLOCK_V, triton.next_power_of_2(v)), num_warps=NUM_WARPS)
        return lse, picked

    @staticmethod
    def grad_(z: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, coef: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
        rows, v = z.shape
        if not rows:
            return z
        if z.stride(1) != 1:  # F.linear's result is row-major; anything else is written through a copy
            dz = z.contiguous()
            TritonChunkKernels.grad_(dz, lse, target, coef, scale)
            return dz
        block = min(BLOCK_V, triton.next_power_of_2(v))
        acc = lse.dtype
        _grad_kernel[(rows, triton.cdiv(v, block))](z, lse, target.contiguous(), coef.to(acc).contiguous(),
                                                    scale.to(acc).contiguous(), v, z.stride(0), BLOCK=block,
                                                    num_warps=NUM_WARPS)
        return z


    @staticmethod
    def stats_grad_(z: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, z_loss: float,
                    row_loss: torch.Tensor) -> None:
        """``stats`` and ``grad_`` in one pass a row, without a vocab-parallel group (target -1: an ignored
        row): ``dz`` written over ``z`` (``coef = scale * (1 + 2 z_loss lse)``) and each row's loss term
        ``lse - z[target] + z_loss lse^2`` (0 where ignored) into ``row_loss``."""
        rows, v = z.shape
        if not rows:
            return
        if z.stride(1) != 1:  # not row-major (never F.linear's output): the two kernels, then back into z
            lse, picked = TritonChunkKernels.stats(z, target)
            torch.where(target >= 0, lse - picked + z_loss * lse * lse, torch.zeros_like(lse), out=row_loss)
            coef = scale * (1.0 + 2.0 * z_loss * lse)
            z.copy_(TritonChunkKernels.grad_(z, lse, target, coef, scale))
            return
        _stats_grad_kernel[(rows,)](z, target.contiguous(), scale.to(row_loss.dtype).contiguous(), row_loss, v,
                                    z.stride(0), float(z_loss), ACC=_acc(z.dtype),
                                    BLOCK=min(FUSED_BLOCK, triton.next_power_of_2(v)), num_warps=FUSED_WARPS)

    @staticmethod
    def scale_(g: torch.Tensor, factor: torch.Tensor) -> None:
        """``g *= factor`` in place; a no-op on the device when ``factor`` is exactly 1."""
        if not g.is_contiguous():
            g.mul_(factor)
            return
        n = g.numel()
        if n:
            factor = factor.reshape(1).to(_math_dtype(g.dtype))
            _scale_kernel[(triton.cdiv(n, SCALE_BLOCK),)](g, factor, n, BLOCK=SCALE_BLOCK, num_warps=8)


#: the op: core's chunked loop with the Triton chunk kernels (cuBLAS for the three GEMMs)
linear_cross_entropy = make_linear_cross_entropy(TritonChunkKernels)
