"""Triton RMSNorm: a fused forward kernel and a fused backward kernel with the weight gradient.

Forward: each program normalises a ``[rows, BLOCK]`` tile of whole rows (``BLOCK =
next_power_of_2(H)``; one row at Llama's widths, several when H is small): squares summed in fp32
(fp64 for fp64 inputs), scaled by ``rstd`` and ``offset + weight``, stored once in x's dtype;
``rstd`` (one fp32 per row) is kept for the backward. Reads x once, writes y once. Rows wider than
:data:`MAX_BLOCK` are read in column chunks (two passes).

Backward: as many programs as the GPU holds at once, each walking a contiguous range of rows a tile
at a time: ``dx = rstd * (g - xhat * mean(g * xhat))`` with ``g = dy * (offset + w)``, stored per
row, and the weight gradient's partial sums ``dy * xhat`` accumulated in registers over the program's
rows, stored as one fp32 row per program; a torch sum over those few rows gives ``dw`` (no atomics,
deterministic). Reads x and dy once, writes dx once. Tiles and warps (:func:`tile_config`): the forward
keeps each thread at 16 elements an array, the backward at up to 32 (four rows a step at Llama's width, 64 KiB
of loads in flight per program, one program per SM): on an H100 at H 4096 that backward took 0.293 ms
against 0.323 ms with two-row steps (benchmarks/RESULTS.md, fourth session of 2026-12-06).

Inputs of any layout: rows of unit column stride and one row stride are read in place; other
layouts are copied to rows first. :data:`rms_norm` is the autograd-aware op built with the
reference's ``make_rms_norm``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from polyaccel.ops.reference.rms_norm import make_rms_norm

#: widest row the forward holds in registers at once; wider rows take the chunked two-pass kernel
MAX_BLOCK = 16384
#: the same for the backward (more arrays live per element); wider rows take the chunked kernel
BWD_MAX_BLOCK = 8192
#: elements of one step's [rows, BLOCK] tile of whole rows, backward and forward; rows per step at most MAX_ROWS
TILE = 16384
FWD_TILE = 4096
MAX_ROWS = 64
MIN_WARPS, MAX_WARPS = 4, 16


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, H, x_stride, y_stride, eps, offset,
                         HAS_W: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """A ``[ROWS, BLOCK]`` tile of whole rows (H <= BLOCK) per program."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    rmask = rows < n_rows
    cmask = cols < H
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(ACC)
    ms = tl.sum(x * x, axis=1) / H + eps
    rstd = 1.0 / tl.sqrt(tl.where(rmask, ms, 1.0))  # (rows past the end: no 1/0 with eps = 0)
    y = x * rstd[:, None]
    if HAS_W:
        y = y * (tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ACC) + offset)[None, :]
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd.to(rstd_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _rms_norm_fwd_wide_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H, x_stride, y_stride, eps, offset,
                              HAS_W: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """One row wider than a block per program, in column chunks: a pass for the sum of squares, one storing y."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * x_stride
    y_row = y_ptr + row * y_stride
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
                         NEED_DW: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """One-pass rows only (H <= BLOCK), ``ROWS`` rows per step (more bytes in flight per program); wider rows
    take :func:`_rms_norm_bwd_wide_kernel`."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cmask = cols < H
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    if HAS_W:
        w = (tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ACC) + offset)[None, :]
    dw = tl.zeros([BLOCK], dtype=ACC)
    for r0 in range(first, last, ROWS):
        rows = r0 + tl.arange(0, ROWS).to(tl.int64)
        rmask = rows < last
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_ptr + rows[:, None] * dy_stride + cols[None, :], mask=mask, other=0.0).to(ACC)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0).to(ACC)[:, None]
        xhat = x * rstd
        if NEED_DX:
            g = dy
            if HAS_W:
                g = dy * w
            c = (tl.sum(g * xhat, axis=1) / H)[:, None]
            tl.store(dx_ptr + rows[:, None] * dx_stride + cols[None, :],
                     ((g - xhat * c) * rstd).to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw += tl.sum(dy * xhat, axis=0)
    if NEED_DW:
        tl.store(dw_part_ptr + pid * H + cols, dw, mask=cmask)


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


def tile_config(block: int, backward: bool) -> tuple[int, int]:
    """(rows per step, warps) for rows of ``block`` columns.

    A step's tile holds :data:`TILE` elements in the backward, :data:`FWD_TILE` in the forward (several rows
    when H is small, so each program moves enough bytes), over up to :data:`MAX_WARPS` warps.
    """
    tile = TILE if backward else FWD_TILE
    rows = max(1, min(MAX_ROWS, tile // block))
    warps = max(MIN_WARPS, min(MAX_WARPS, rows * block // (32 * 16)))
    return rows, warps


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 1  # the interpreter: ranges of rows and the partial sums are still exercised


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, *,
                     max_block: int = MAX_BLOCK, rows_per_step: int | None = None, num_warps: int | None = None):
    """``(y, rstd)`` in one kernel: y like x (a new contiguous tensor), rstd fp32 (fp64 for fp64 x) per row.

    Arguments as the op's contract allows (the op checks them: :data:`rms_norm`). ``rows_per_step`` and
    ``num_warps`` override :func:`tile_config` (for tuning).
    """
    H = x.shape[-1]
    xr = _rows(x)
    n = xr.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    rstd = torch.empty(x.shape[:-1], dtype=acc_dtype, device=x.device)
    if not n:
        return y, rstd
    block = min(triton.next_power_of_2(H), max_block)
    w = weight.contiguous() if weight is not None else xr  # (not read without a weight)
    common = dict(HAS_W=weight is not None, ACC=_acc(x.dtype), BLOCK=block)
    if block >= H:
        rows, warps = tile_config(block, backward=False)
        rows, warps = rows_per_step or rows, num_warps or warps
        _rms_norm_fwd_kernel[(triton.cdiv(n, rows),)](xr, w, y, rstd, n, H, _row_stride(xr), H, float(eps),
                                                      float(offset), ROWS=rows, num_warps=warps, **common)
    else:
        _rms_norm_fwd_wide_kernel[(n,)](xr, w, y, rstd, H, _row_stride(xr), H, float(eps), float(offset),
                                        num_warps=num_warps or MAX_WARPS, **common)
    return y, rstd


def rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                      offset: float, need_dx: bool = True, need_dw: bool = True, *, max_block: int = BWD_MAX_BLOCK,
                      programs: int | None = None, rows_per_step: int | None = None, num_warps: int | None = None):
    """``(dx, dw)`` (None where not needed) in one kernel plus a sum over the programs' partial weight gradients.

    ``programs`` (default: as many as fit on the GPU at once, :func:`tile_config`'s warps at 128 registers a
    thread), ``rows_per_step`` and ``num_warps`` override the configuration (for tuning).
    """
    H = x.shape[-1]
    need_dw = need_dw and weight is not None
    if not (need_dx or need_dw):
        return None, None
    xr, dyr = _rows(x), _rows(grad_out)
    n = xr.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else None
    if not n:
        return dx, (torch.zeros_like(weight) if need_dw else None)
    block = min(triton.next_power_of_2(H), max_block)
    one_pass = block >= H
    rows, warps = tile_config(block, backward=True) if one_pass else (1, MAX_WARPS)
    rows, warps = rows_per_step or rows, num_warps or warps
    # CTAs an SM holds at once: 64K registers over 128 a thread (one at the 16 warps the backward tiles get)
    resident = max(1, 65536 // (128 * 32 * warps)) if one_pass else 1
    progs = programs or _sm_count(x.device) * resident
    per = triton.cdiv(n, progs)
    if one_pass:
        per = triton.cdiv(per, rows) * rows  # whole steps per program
    progs = triton.cdiv(n, per)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if need_dw:
        part = (torch.empty if one_pass else torch.zeros)((progs, H), dtype=acc_dtype, device=x.device)
    else:
        part = rstd  # (not written)
    args = (dyr, xr, weight.contiguous() if weight is not None else xr, rstd.contiguous(),
            dx if dx is not None else xr, part, n, H, per, _row_stride(dyr), _row_stride(xr), H, float(offset))
    common = dict(HAS_W=weight is not None, NEED_DX=need_dx, NEED_DW=need_dw, ACC=_acc(x.dtype), BLOCK=block,
                  num_warps=warps)
    if one_pass:
        _rms_norm_bwd_kernel[(progs,)](*args, ROWS=rows, **common)
    else:
        _rms_norm_bwd_wide_kernel[(progs,)](*args, **common)
    dw = part.sum(0).to(weight.dtype) if need_dw else None
    return dx, dw


#: the op: autograd-aware ``rms_norm(x, weight, eps=1e-6, *, offset=0.0)`` running the two kernels above
rms_norm = make_rms_norm(rms_norm_forward, rms_norm_backward)
