"""Triton RMSNorm: a fused forward kernel and a fused backward kernel with the weight gradient.

Forward: one program per row; the whole row sits in registers (``BLOCK = next_power_of_2(H)``),
is squared and summed in fp32 (fp64 for fp64 inputs), scaled by ``rstd`` and ``offset + weight``
and stored once in x's dtype; ``rstd`` (one fp32 per row) is kept for the backward. Rows wider
than :data:`MAX_BLOCK` are read in column chunks (two passes). Reads x once, writes y once.

Backward: a fixed number of programs (a few per SM), each walking a contiguous range of rows:
``dx = rstd * (g - xhat * mean(g * xhat))`` with ``g = dy * (offset + w)``, stored per row, and
the weight gradient's partial sums ``dy * xhat`` accumulated in registers over the program's rows,
then stored as one fp32 row per program; a torch sum over those few rows gives ``dw`` (no
atomics, deterministic). Reads x and dy once, writes dx once.

Inputs of any layout: rows of unit column stride and one row stride are read in place; other
layouts are copied to rows first. :data:`rms_norm` is the autograd-aware op built with the
reference's ``make_rms_norm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from polyaccel.ops.reference.rms_norm import make_rms_norm

#: widest row held in registers at once; wider rows take the chunked two-pass path
MAX_BLOCK = 16384
#: backward programs per SM (each walks a range of rows); several per SM hide memory latency
PROGRAMS_PER_SM = 4


def num_warps_for(block: int) -> int:
    """Warps per program by row width: enough threads that each holds a few elements."""
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    if block >= 512:
        return 4
    return 2


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H, x_stride, y_stride, eps, offset, HAS_W: tl.constexpr,
                         ONE_PASS: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * x_stride
    y_row = y_ptr + row * y_stride
    if ONE_PASS:
        mask = cols < H
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(ACC)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        y = x * rstd
        if HAS_W:
            y = y * (tl.load(w_ptr + cols, mask=mask, other=0.0).to(ACC) + offset)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=ACC)
        for start in range(0, H, BLOCK):
            c = start + cols
            x = tl.load(x_row + c, mask=c < H, other=0.0).to(ACC)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
        for start in range(0, H, BLOCK):
            c = start + cols
            mask = c < H
            y = tl.load(x_row + c, mask=mask, other=0.0).to(ACC) * rstd
            if HAS_W:
                y = y * (tl.load(w_ptr + c, mask=mask, other=0.0).to(ACC) + offset)
            tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd.to(rstd_ptr.dtype.element_ty))


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, H, rows_per_program,
                         dy_stride, x_stride, dx_stride, offset, HAS_W: tl.constexpr, NEED_DX: tl.constexpr,
                         NEED_DW: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """One-pass rows only (H <= BLOCK); wider rows take :func:`_rms_norm_bwd_wide_kernel`."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(ACC) + offset
    dw = tl.zeros([BLOCK], dtype=ACC)
    for row in range(first, last):
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_ptr + row * dy_stride + cols, mask=mask, other=0.0).to(ACC)
        rstd = tl.load(rstd_ptr + row).to(ACC)
        xhat = x * rstd
        if NEED_DX:
            g = dy * w if HAS_W else dy
            c = tl.sum(g * xhat, axis=0) / H
            tl.store(dx_ptr + row * dx_stride + cols, ((g - xhat * c) * rstd).to(dx_ptr.dtype.element_ty),
                     mask=mask)
        if NEED_DW:
            dw += dy * xhat
    if NEED_DW:
        tl.store(dw_part_ptr + pid * H + cols, dw, mask=mask)


@triton.jit
def _rms_norm_bwd_wide_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, H, rows_per_program,
                              dy_stride, x_stride, dx_stride, offset, HAS_W: tl.constexpr, NEED_DX: tl.constexpr,
                              NEED_DW: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """Rows wider than one block: per row a pass for ``mean(g * xhat)`` then a pass storing dx; the weight
    gradient's partial sums go straight to this program's fp32 row (read, add, write: the program owns it)."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for row in range(first, last):
        rstd = tl.load(rstd_ptr + row).to(ACC)
        dot = tl.zeros([BLOCK], dtype=ACC)
        for start in range(0, H, BLOCK):
            c = start + cols
            mask = c < H
            xhat = tl.load(x_ptr + row * x_stride + c, mask=mask, other=0.0).to(ACC) * rstd
            dy = tl.load(dy_ptr + row * dy_stride + c, mask=mask, other=0.0).to(ACC)
            if NEED_DW:
                part = dw_part_ptr + pid * H + c
                tl.store(part, tl.load(part, mask=mask, other=0.0) + dy * xhat, mask=mask)
            if HAS_W:
                dy = dy * (tl.load(w_ptr + c, mask=mask, other=0.0).to(ACC) + offset)
            dot += dy * xhat
        if NEED_DX:
            mean = tl.sum(dot, axis=0) / H
            for start in range(0, H, BLOCK):
                c = start + cols
                mask = c < H
                xhat = tl.load(x_ptr + row * x_stride + c, mask=mask, other=0.0).to(ACC) * rstd
                g = tl.load(dy_ptr + row * dy_stride + c, mask=mask, other=0.0).to(ACC)
                if HAS_W:
                    g = g * (tl.load(w_ptr + c, mask=mask, other=0.0).to(ACC) + offset)
                tl.store(dx_ptr + row * dx_stride + c, ((g - xhat * mean) * rstd).to(dx_ptr.dtype.element_ty),
                         mask=mask)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, H]`` with unit column stride (a view where possible, else a copy)."""
    r = t.reshape(-1, t.shape[-1])
    return r if r.stride(-1) == 1 or r.shape[-1] == 1 else r.contiguous()


def _row_stride(r: torch.Tensor) -> int:
    return r.stride(0) if r.shape[0] > 1 else r.shape[1]


def _programs(device: torch.device, n_rows: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:  # the interpreter: a few programs, so that ranges of rows and the partial sums are exercised
        sms = 2
    return max(1, min(n_rows, PROGRAMS_PER_SM * sms))


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, *,
                     max_block: int = MAX_BLOCK):
    """``(y, rstd)`` in one kernel: y like x (a new contiguous tensor), rstd fp32 (fp64 for fp64 x) per row.

    Arguments as the op's contract allows (the op checks them: :data:`rms_norm`).
    """
    H = x.shape[-1]
    xr = _rows(x)
    n = xr.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    rstd = torch.empty(x.shape[:-1], dtype=acc_dtype, device=x.device)
    if n:
        block = min(triton.next_power_of_2(H), max_block)
        w = weight.contiguous() if weight is not None else xr  # (not read without a weight)
        _rms_norm_fwd_kernel[(n,)](xr, w, y, rstd, H, _row_stride(xr), H, float(eps), float(offset),
                                   HAS_W=weight is not None, ONE_PASS=block >= H, ACC=_acc(x.dtype), BLOCK=block,
                                   num_warps=num_warps_for(block))
    return y, rstd


def rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                      offset: float, need_dx: bool = True, need_dw: bool = True, *, max_block: int = MAX_BLOCK,
                      programs: int | None = None):
    """``(dx, dw)`` (None where not needed) in one kernel plus a sum over the programs' partial weight gradients."""
    H = x.shape[-1]
    need_dw = need_dw and weight is not None
    xr, dyr = _rows(x), _rows(grad_out)
    n = xr.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else None
    if not (need_dx or need_dw):
        return None, None
    if not n:
        return dx, (torch.zeros_like(weight) if need_dw else None)
    block = min(triton.next_power_of_2(H), max_block)
    progs = programs or _programs(x.device, n)
    per = triton.cdiv(n, progs)
    progs = triton.cdiv(n, per)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    part = (torch.zeros if block < H else torch.empty)((progs, H), dtype=acc_dtype, device=x.device) if need_dw \
        else rstd
    kernel = _rms_norm_bwd_kernel if block >= H else _rms_norm_bwd_wide_kernel
    kernel[(progs,)](dyr, xr, weight.contiguous() if weight is not None else xr, rstd.contiguous(),
                     dx if dx is not None else xr, part, n, H, per, _row_stride(dyr), _row_stride(xr), H,
                     float(offset), HAS_W=weight is not None, NEED_DX=need_dx, NEED_DW=need_dw, ACC=_acc(x.dtype),
                     BLOCK=block, num_warps=num_warps_for(block))
    dw = part.sum(0).to(weight.dtype) if need_dw else None
    return dx, dw


#: the op: autograd-aware ``rms_norm(x, weight, eps=1e-6, *, offset=0.0)`` running the two kernels above
rms_norm = make_rms_norm(rms_norm_forward, rms_norm_backward)
