"""Triton chunk kernels of ``linear_cross_entropy``: the logits chunk's statistics and its gradient in place.

The op is core's chunked loop (:mod:`polyaccel.ops.chunked_loss`): per chunk of tokens, cuBLAS
computes the logits ``[rows, V_local]`` in the input dtype, these kernels do the rest of the
chunk's math, and cuBLAS spends the gradient (``dz @ W``, ``dz.T @ h``). Two kernels:

* :func:`stats`: one program per row, an online logsumexp over the row in blocks of columns (fp32
  math, fp64 for fp64 input) and the target column's logit: one read of the chunk;
* :func:`grad_`: ``dz = coef * exp(z - lse) - scale * onehot(target)`` written over the logits
  chunk (same dtype, same memory): one read and one write, a 2-D grid over rows and column blocks.

Compared with torch's chunk math (an fp32 copy of the chunk, logsumexp's temporaries, the
exp and scatter passes), the chunk needs no memory beyond its logits and three passes instead
of about eight. 64-bit offsets: a chunk may pass 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from polyaccel.ops.chunked_loss import make_linear_cross_entropy

#: columns per step of a row (stats) and per program (grad)
BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _stats_kernel(z_ptr, target_ptr, lse_ptr, picked_ptr, V, stride, ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), ACC)
    s = tl.zeros((BLOCK,), ACC)
    for start in range(0, V, BLOCK):
        offs = start + cols
        z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, z)
        # lanes still at -inf (no column yet) contribute nothing: exp(-inf - -inf) would be NaN
        s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.exp(z - m_new))
        m = m_new
    row_max = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - row_max), 0)
    tl.store(lse_ptr + row, row_max + tl.log(total))
    t = tl.load(target_ptr + row)
    picked = tl.load(base + tl.maximum(t, 0)).to(ACC)
    tl.store(picked_ptr + row, tl.where(t >= 0, picked, 0.0))


@triton.jit
def _grad_kernel(z_ptr, lse_ptr, target_ptr, coef_ptr, scale_ptr, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < V
    ptrs = z_ptr + row * stride + offs
    lse = tl.load(lse_ptr + row)
    z = tl.load(ptrs, mask=mask, other=0.0).to(lse.dtype)
    dz = tl.load(coef_ptr + row) * tl.exp(z - lse)
    dz = tl.where(offs == tl.load(target_ptr + row), dz - tl.load(scale_ptr + row), dz)
    tl.store(ptrs, dz.to(z_ptr.dtype.element_ty), mask=mask)


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


#: the op: core's chunked loop with the Triton chunk kernels (cuBLAS for the three GEMMs)
linear_cross_entropy = make_linear_cross_entropy(TritonChunkKernels)
