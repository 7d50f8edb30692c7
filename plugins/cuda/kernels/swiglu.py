"""Triton SwiGLU: ``silu(gate) * up`` with a fused forward and a fused backward kernel.

Both kernels are one pass over the elements (math in fp32, the forward's in fp64 for fp64 inputs;
results stored in the input dtype),
with 64-bit program ids and offsets so tensors past 2**31 elements work. Inputs are read as rows
with a row stride, so ``gate`` and ``up`` may be the two halves of one ``[N, 2F]`` projection
(``h.chunk(2, -1)``) without a copy; the backward then writes its two gradients as the halves of
one ``[N, 2F]`` tensor (otherwise outputs are contiguous). The forward reads gate and up
and writes out (3 tensor passes); the backward reads grad_out, gate and up and writes d_gate
and d_up (5 passes), recomputing the sigmoid instead of storing it. :data:`swiglu` is the
autograd-aware op built with the reference ``make_swiglu``.

:data:`weighted_swiglu` also scales each row by its weight, so a MoE layer whose every token goes
to every expert applies the router weights here without a pass of their own: the same forward
kernel with the weights loaded, and a backward of its own that runs one program per row and also
sums that row's weight gradient (math in fp32, fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from polyaccel.errors import OpArgumentError
from polyaccel.ops.reference.swiglu import (
    check_swiglu_args,
    check_weighted_swiglu_args,
    halves_of,
    make_swiglu,
    make_weighted_swiglu,
)

#: elements per program and warps per program (one configuration: both kernels are memory-bound)
BLOCK = 4096
NUM_WARPS = 8
#: columns per step of the weighted backward's row loop, and its warps
MAX_BLOCK_F = 1024
ROW_NUM_WARPS = 4


@triton.jit
def _swiglu_fwd_kernel(gate_ptr, up_ptr, w_ptr, out_ptr, n, cols, g_stride, u_stride, HAS_W: tl.constexpr,
                       ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    row, col = offs // cols, offs % cols
    g = tl.load(gate_ptr + row * g_stride + col, mask=mask, other=0.0).to(ACC)
    u = tl.load(up_ptr + row * u_stride + col, mask=mask, other=0.0).to(ACC)
    out = g * tl.sigmoid(g) * u
    if HAS_W:  # weighted_swiglu: the row's weight
        out = out * tl.load(w_ptr + row, mask=mask, other=0.0).to(ACC)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(grad_ptr, gate_ptr, up_ptr, d_gate_ptr, d_up_ptr, n, cols, g_stride, u_stride, d_stride,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    row, col = offs // cols, offs % cols
    go = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * g_stride + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * u_stride + col, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    d_gate = go * u * sig * (1.0 + g * (1.0 - sig))
    d_up = go * silu
    tl.store(d_gate_ptr + row * d_stride + col, d_gate.to(d_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(d_up_ptr + row * d_stride + col, d_up.to(d_up_ptr.dtype.element_ty), mask=mask)


def _acc(dtype: torch.dtype):
    """The math dtype: fp64 for fp64 inputs, else fp32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _grid(n: int, block: int):
    return ((n + block - 1) // block,)  # (triton.cdiv in plain integers: no constexpr-function call on the host)


def _next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= ``n`` (``n >= 1``): ``triton.next_power_of_2`` in plain integers."""
    return 1 << (n - 1).bit_length()


def _cols(t: torch.Tensor) -> int:
    return t.shape[-1] if t.dim() and t.shape[-1] else 1


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` (or a contiguous copy) and its row stride, for rows of ``_cols(t)`` unit-stride elements.

    Contiguous tensors and row-strided 2-D views (a half of ``h.chunk(2, -1)``) are read in
    place; any other layout is copied first.
    """
    if not t.is_contiguous() and not (t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1]):
        t = t.contiguous()
    return t, (t.stride(0) if t.dim() == 2 else _cols(t))


def _gradients_like(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(d_gate, d_up, their row stride): the two halves of one new ``[N, 2F]`` tensor when ``gate`` and ``up``
    are the halves of one (``halves_of``), else two contiguous tensors."""
    h = halves_of(gate, up)
    if h is not None:
        d_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        d_gate, d_up = d_h.chunk(2, dim=-1)
        return d_gate, d_up, d_h.stride(0)
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    return d_gate, torch.empty(up.shape, dtype=up.dtype, device=up.device), _cols(gate)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, *, block: int = BLOCK, num_warps: int = NUM_WARPS):
    """``silu(gate) * up`` in one kernel (a contiguous result; see :func:`_rows` for the input layouts)."""
    check_swiglu_args(gate, up)
    return _forward(gate, up, None, block, num_warps)


def _forward(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None, block: int, num_warps: int):
    """The forward kernel of both ops (``weights`` None: plain swiglu)."""
    (gate, gs), (up, us) = _rows(gate), _rows(up)
    out = gate.new_empty(gate.shape)  # (contiguous)
    n = gate.numel()
    if n:
        w = gate if weights is None else weights.contiguous()  # (not read without weights)
        _swiglu_fwd_kernel[_grid(n, block)](gate, up, w, out, n, _cols(gate), gs, us, HAS_W=weights is not None,
                                            ACC=_acc(gate.dtype), BLOCK=block, num_warps=num_warps)
    return out


def swiglu_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, block: int = BLOCK,
                    num_warps: int = NUM_WARPS):
    """(d_gate, d_up) of ``out = silu(gate) * up`` in one kernel.

    Contiguous results, except when ``gate`` and ``up`` are the two halves of one ``[N, 2F]`` tensor
    (``halves_of``): then the gradients are the two halves of one new ``[N, 2F]`` tensor, so a caller
    that split ``h`` can hand back its gradient without concatenating (AutoEP's experts do).
    """
    check_swiglu_args(gate, up)
    if grad_out.shape != gate.shape:
        raise OpArgumentError(f"swiglu backward: grad_out {tuple(grad_out.shape)} does not match gate "
                         f"{tuple(gate.shape)}")
    return _backward(grad_out, gate, up, block, num_warps)


def _backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, block: int, num_warps: int):
    """:func:`swiglu_backward` on checked arguments."""
    grad_out = grad_out.contiguous()
    d_gate, d_up, d_stride = _gradients_like(gate, up)
    (gate, gs), (up, us) = _rows(gate), _rows(up)
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[_grid(n, block)](grad_out, gate, up, d_gate, d_up, n, _cols(gate), gs, us, d_stride,
                                            BLOCK=block, num_warps=num_warps)
    return d_gate, d_up


def swiglu_of_halves(gu: torch.Tensor, *, block: int = BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """``swiglu(*gu.chunk(2, -1))`` of a 2-D ``gu`` [N, 2F] the caller made (no argument checks), read in place:
    the forward kernel's launch for the halves of one tensor without finding them first (``_rows``)."""
    gu = gu.contiguous()  # (a no-op for a GEMM's result)
    N, F2 = gu.shape
    F = F2 // 2
    out = gu.new_empty((N, F))
    n = N * F
    if n:  # (gu is where its gate half starts: the kernel reads F columns a row)
        up = gu.narrow(1, F, F)
        _swiglu_fwd_kernel[_grid(n, block)](gu, up, gu, out, n, F, F2, F2, HAS_W=False, ACC=_acc(gu.dtype),
                                            BLOCK=block, num_warps=num_warps)
    return out


def swiglu_of_halves_backward(grad_out: torch.Tensor, gu: torch.Tensor, *, block: int = BLOCK,
                              num_warps: int = NUM_WARPS) -> torch.Tensor:
    """``gu``'s gradient [N, 2F] (d_gate then d_up in each row) for ``out = swiglu_of_halves(gu)``, ``grad_out``
    shaped like ``out`` (no argument checks): :func:`swiglu_backward`'s kernel writing the halves of one tensor."""
    gu = gu.contiguous()
    N, F2 = gu.shape
    F = F2 // 2
    d_gu = torch.empty_like(gu)  # (contiguous, as gu)
    n = N * F
    if n:  # (gu and d_gu are where their gate halves start)
        _swiglu_bwd_kernel[_grid(n, block)](grad_out.contiguous(), gu, gu.narrow(1, F, F), d_gu, d_gu.narrow(1, F, F),
                                            n, F, F2, F2, F2, BLOCK=block, num_warps=num_warps)
    return d_gu


def _op_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _forward(gate, up, None, BLOCK, NUM_WARPS)


def _op_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    return _backward(grad_out, gate, up, BLOCK, NUM_WARPS)


#: the op: autograd-aware ``swiglu(gate, up)`` running the two kernels above. ``make_swiglu``'s op checks the
#: arguments before its autograd node, so the node's forward and backward do not check them again (the
#: backward's ``grad_out`` has the output's shape: autograd checks each gradient against its output's)
swiglu = make_swiglu(_op_forward, _op_backward)


# ------------------------------------------------------------------------- weighted_swiglu
@triton.jit
def _weighted_swiglu_bwd_kernel(grad_ptr, gate_ptr, up_ptr, w_ptr, d_gate_ptr, d_up_ptr, d_w_ptr, F, g_stride,
                                u_stride, d_stride, HAS_DW: tl.constexpr, ACC: tl.constexpr,
                                BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    span = tl.arange(0, BLOCK_F).to(tl.int64)
    w = tl.load(w_ptr + row).to(ACC)
    dot = tl.zeros([BLOCK_F], dtype=ACC)
    for start in range(0, F, BLOCK_F):
        col = start + span
        mask = col < F
        go = tl.load(grad_ptr + row * F + col, mask=mask, other=0.0).to(ACC)
        g = tl.load(gate_ptr + row * g_stride + col, mask=mask, other=0.0).to(ACC)
        u = tl.load(up_ptr + row * u_stride + col, mask=mask, other=0.0).to(ACC)
        sig = tl.sigmoid(g)
        silu = g * sig
        gw = go * w
        d_gate = gw * u * sig * (1.0 + g * (1.0 - sig))
        tl.store(d_gate_ptr + row * d_stride + col, d_gate.to(d_gate_ptr.dtype.element_ty), mask=mask)
        tl.store(d_up_ptr + row * d_stride + col, (gw * silu).to(d_up_ptr.dtype.element_ty), mask=mask)
        if HAS_DW:
            dot += go * silu * u
    if HAS_DW:
        tl.store(d_w_ptr + row, tl.sum(dot, axis=0).to(d_w_ptr.dtype.element_ty))


def weighted_swiglu_forward(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor, *, block: int = BLOCK,
                            num_warps: int = NUM_WARPS):
    """``silu(gate) * up * weights[:, None]`` in one kernel (a contiguous result; inputs as for swiglu)."""
    check_weighted_swiglu_args(gate, up, weights)
    return _forward(gate, up, weights, block, num_warps)


def weighted_swiglu_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor,
                             need_d_weights: bool, *, max_block_f: int = MAX_BLOCK_F,
                             num_warps: int = ROW_NUM_WARPS):
    """(d_gate, d_up, d_weights or None) of ``out = silu(gate) * up * weights[:, None]``, one program per row.

    d_weights is in ``weights``' dtype; d_gate and d_up are laid out as :func:`swiglu_backward`'s.
    """
    check_weighted_swiglu_args(gate, up, weights)
    if grad_out.shape != gate.shape:
        raise OpArgumentError(f"weighted_swiglu backward: grad_out {tuple(grad_out.shape)} does not match gate "
                              f"{tuple(gate.shape)}")
    return _weighted_backward(grad_out, gate, up, weights, need_d_weights, max_block_f, num_warps)


def _weighted_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor,
                       need_d_weights: bool, max_block_f: int, num_warps: int):
    """:func:`weighted_swiglu_backward` on checked arguments."""
    grad_out = grad_out.contiguous()
    N, F = gate.shape
    d_gate, d_up, d_stride = _gradients_like(gate, up)
    d_w = None
    if need_d_weights:
        # F == 0 launches nothing: each row's sum is then the empty sum
        d_w = (torch.empty if F else torch.zeros)(N, dtype=weights.dtype, device=weights.device)
    if N and F:
        (gate, gs), (up, us) = _rows(gate), _rows(up)
        block_f = min(max_block_f, _next_power_of_2(F))
        _weighted_swiglu_bwd_kernel[(N,)](
            grad_out, gate, up, weights.contiguous(), d_gate, d_up, d_w if d_w is not None else grad_out, F, gs, us,
            d_stride, HAS_DW=need_d_weights, ACC=_acc(gate.dtype), BLOCK_F=block_f, num_warps=num_warps)
    return d_gate, d_up, d_w


def _weighted_op_forward(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return _forward(gate, up, weights, BLOCK, NUM_WARPS)


def _weighted_op_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor,
                          need_d_weights: bool):
    return _weighted_backward(grad_out, gate, up, weights, need_d_weights, MAX_BLOCK_F, ROW_NUM_WARPS)


#: the op: autograd-aware ``weighted_swiglu(gate, up, weights)`` running the two kernels above (checked once,
#: as ``swiglu``)
weighted_swiglu = make_weighted_swiglu(_weighted_op_forward, _weighted_op_backward)
