"""Triton SwiGLU: ``silu(gate) * up`` with a fused forward and a fused backward kernel.

Both kernels are one pass over flat, contiguous tensors (math in fp32, results stored in the
input dtype), with 64-bit program ids and offsets so tensors past 2**31 elements work. The
forward reads gate and up and writes out (3 tensor passes); the backward reads grad_out,
gate and up and writes d_gate and d_up (5 passes), recomputing the sigmoid instead of storing
it. :data:`swiglu` is the autograd-aware op built with the reference ``make_swiglu``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from polyaccel.errors import OpArgumentError
from polyaccel.ops.reference.swiglu import check_swiglu_args, make_swiglu

#: elements per program and warps per program (one configuration: both kernels are memory-bound)
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(grad_ptr, gate_ptr, up_ptr, d_gate_ptr, d_up_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    go = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    d_gate = go * u * sig * (1.0 + g * (1.0 - sig))
    d_up = go * silu
    tl.store(d_gate_ptr + offs, d_gate.to(d_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(d_up_ptr + offs, d_up.to(d_up_ptr.dtype.element_ty), mask=mask)


def _grid(n: int, block: int):
    return (triton.cdiv(n, block),)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, *, block: int = BLOCK, num_warps: int = NUM_WARPS):
    """``silu(gate) * up`` in one kernel; non-contiguous inputs are made contiguous first."""
    check_swiglu_args(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel[_grid(n, block)](gate, up, out, n, BLOCK=block, num_warps=num_warps)
    return out


def swiglu_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, block: int = BLOCK,
                    num_warps: int = NUM_WARPS):
    """(d_gate, d_up) of ``out = silu(gate) * up`` in one kernel."""
    check_swiglu_args(gate, up)
    if grad_out.shape != gate.shape:
        raise OpArgumentError(f"swiglu backward: grad_out {tuple(grad_out.shape)} does not match gate "
                         f"{tuple(gate.shape)}")
    grad_out, gate, up = grad_out.contiguous(), gate.contiguous(), up.contiguous()
    d_gate = torch.empty_like(gate)
    d_up = torch.empty_like(up)
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[_grid(n, block)](grad_out, gate, up, d_gate, d_up, n, BLOCK=block, num_warps=num_warps)
    return d_gate, d_up


#: the op: autograd-aware ``swiglu(gate, up)`` running the two kernels above
swiglu = make_swiglu(swiglu_forward, swiglu_backward)
