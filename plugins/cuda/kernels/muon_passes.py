"""Triton kernels of Muon's element-wise passes over pieces of flat buffers: ``muon_momentum`` and ``muon_apply``.

A ZeRO round's Muon pieces are runs of elements at offsets of a few flat buffers (the gradient partition, the
momentum state, the round buffer, the master partition). Each pass is one launch for all pieces of a call: a
*piece table* on the device holds every piece's offset into each buffer and its length, and which piece and
element each program starts at; the buffers' base addresses are plain kernel arguments. The table depends only
on the offsets, so it is built once (host work and one host-to-device copy) and cached: a step reuses it when the
round buffer is allocated elsewhere.

Arithmetic follows the reference's torch ops element for element: torch's ``lerp`` formula (the branch on
``|weight| < 0.5`` decided once on the host, for the weight rounded to float32 as torch rounds it), the
momentum in float32 with the gradient widened exactly, the update rounded once into the output's dtype; the
apply pass rounds ``p * (1 - lr * wd)`` to the params' dtype before adding ``(-lr * scale) * O``, with both
factors computed in double and rounded to float32, as torch's multi-tensor ``mul_``/``add_`` round scalars.
float64 buffers go to the reference (the kernels compute in float32).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from polyaccel.errors import OpArgumentError
from polyaccel.ops.reference import muon_passes as ref

from ..triton_support import interpreting
from .chunk_table import chunk_layout, launch_config, upload

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
#: offsets aligned to this many elements let the kernels load whole vectors
_ALIGN = 16
_CACHE_SIZE = 64


# ----------------------------------------------------------------------------- the piece table
@dataclass(eq=False)
class PieceTable:
    """Pieces on the device: ``offsets`` int64 [L*N] (buffer l's offset of piece i at ``l*N + i``), ``lengths``
    int64 [N], and per program ``chunk_piece`` / ``chunk_start`` int64 [C]."""

    n_pieces: int
    n_chunks: int
    aligned: bool
    offsets: torch.Tensor
    lengths: torch.Tensor
    chunk_piece: torch.Tensor
    chunk_start: torch.Tensor


_tables: OrderedDict[tuple, PieceTable] = OrderedDict()
_lock = threading.Lock()


def clear_cache() -> None:
    """Drop the cached piece and factor tables."""
    with _lock:
        _tables.clear()
        _factors.clear()


def piece_table(offset_lists, lengths, chunk: int, device: torch.device) -> PieceTable | None:
    """The (cached) table of the pieces; None when they hold no element."""
    key = (tuple(map(tuple, offset_lists)), tuple(lengths), chunk, device)
    with _lock:
        table = _tables.get(key)
        if table is not None:
            _tables.move_to_end(key)
            return table
    n = len(lengths)
    lens = torch.tensor(lengths, dtype=torch.int64)
    _, chunk_piece, chunk_start = chunk_layout(lens, chunk)
    n_chunks = len(chunk_start)
    if n_chunks == 0:
        return None
    offs = torch.tensor([o for lst in offset_lists for o in lst], dtype=torch.int64)
    aligned = all(o % _ALIGN == 0 for lst in offset_lists for o in lst)
    dev = upload(torch.cat([offs, lens, chunk_piece, chunk_start]), device)
    parts = torch.split(dev, [len(offs), n, n_chunks, n_chunks])
    table = PieceTable(n, n_chunks, aligned, *parts)
    with _lock:
        _tables[key] = table
        while len(_tables) > _CACHE_SIZE:
            _tables.popitem(last=False)
    return table


def _check_device(op: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
        raise OpArgumentError(f"{op}: the Triton kernel needs CUDA tensors, got tensors on {t.device} "
                              "(on CPU it runs only under TRITON_INTERPRET=1, for tests)")


# ----------------------------------------------------------------------------- jit helpers
@triton.jit
def _lerp(start, end, w, one_minus_w, SMALL: tl.constexpr):
    """torch's lerp: ``start + w (end - start)`` for |w| < 0.5, else ``end - (end - start)(1 - w)``."""
    if SMALL:
        r = start + w * (end - start)
    else:
        r = end - (end - start) * one_minus_w
    return r


@triton.jit
def _piece(table_offsets, lengths, chunk_piece, chunk_start, n_pieces, L: tl.constexpr, ALIGNED: tl.constexpr,
           BLOCK: tl.constexpr):
    """(piece, first element of this program, piece length, the piece's offsets into up to three buffers)."""
    pid = tl.program_id(0).to(tl.int64)
    i = tl.load(chunk_piece + pid)
    start = tl.multiple_of(tl.load(chunk_start + pid), BLOCK)
    n = tl.load(lengths + i)
    o0 = tl.load(table_offsets + i)
    o1 = tl.load(table_offsets + n_pieces + i)
    if L > 2:
        o2 = tl.load(table_offsets + 2 * n_pieces + i)
    else:
        o2 = o1
    if ALIGNED:
        o0 = tl.multiple_of(o0, 16)
        o1 = tl.multiple_of(o1, 16)
        o2 = tl.multiple_of(o2, 16)
    return i, start, n, o0, o1, o2


# ----------------------------------------------------------------------------- muon_momentum
@triton.jit
def _momentum_block(g_ptr, b_ptr, o_ptr, offs, mask, w, one_minus_w, m, one_minus_m, NESTEROV: tl.constexpr,
                    W_SMALL: tl.constexpr, M_SMALL: tl.constexpr, MASKED: tl.constexpr):
    if MASKED:
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask)
    else:
        g = tl.load(g_ptr + offs).to(tl.float32)
        b = tl.load(b_ptr + offs)
    b = _lerp(b, g, w, one_minus_w, W_SMALL)
    if NESTEROV:
        u = _lerp(g, b, m, one_minus_m, M_SMALL)
    else:
        u = b
    if MASKED:
        tl.store(b_ptr + offs, b, mask=mask)
        tl.store(o_ptr + offs, u.to(o_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(b_ptr + offs, b)
        tl.store(o_ptr + offs, u.to(o_ptr.dtype.element_ty))


@triton.jit
def _momentum_kernel(g_base, b_base, o_base, table_offsets, lengths, chunk_piece, chunk_start, n_pieces,
                     w, m, NESTEROV: tl.constexpr, W_SMALL: tl.constexpr, M_SMALL: tl.constexpr,
                     ALIGNED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    _, start, n, go, bo, oo = _piece(table_offsets, lengths, chunk_piece, chunk_start, n_pieces, 3, ALIGNED, BLOCK)
    one_minus_w = 1.0 - w
    one_minus_m = 1.0 - m
    g_ptr = g_base + go
    b_ptr = b_base + bo
    o_ptr = o_base + oo
    if start + BLOCK * ITERS <= n:
        for k in tl.static_range(ITERS):
            offs = start + k * BLOCK + tl.arange(0, BLOCK)
            _momentum_block(g_ptr, b_ptr, o_ptr, offs, None, w, one_minus_w, m, one_minus_m, NESTEROV, W_SMALL,
                            M_SMALL, False)
    else:
        for k in tl.static_range(ITERS):
            offs = start + k * BLOCK + tl.arange(0, BLOCK)
            _momentum_block(g_ptr, b_ptr, o_ptr, offs, offs < n, w, one_minus_w, m, one_minus_m, NESTEROV,
                            W_SMALL, M_SMALL, True)


def _small(weight: float) -> bool:
    """torch's ``|weight| < 0.5`` test, on the weight as its float32 kernels see it."""
    return abs(torch.tensor(weight, dtype=torch.float32).item()) < 0.5


def muon_momentum(grad, momentum_buffer, out, *, grad_offsets, buffer_offsets, out_offsets, lengths, momentum,
                  nesterov=True):
    """One launch for every piece (float32 momentum); float64 buffers through the reference."""
    if momentum_buffer.dtype != torch.float32 or out.dtype not in _TL or grad.dtype not in _TL:
        ref.muon_momentum(grad, momentum_buffer, out, grad_offsets=grad_offsets, buffer_offsets=buffer_offsets,
                          out_offsets=out_offsets, lengths=lengths, momentum=momentum, nesterov=nesterov)
        return
    _check_device("muon_momentum", grad)
    block, iters, warps = launch_config(torch.float32)
    table = piece_table((grad_offsets, buffer_offsets, out_offsets), lengths, block * iters, grad.device)
    if table is None:
        return
    w = 1 - momentum
    _momentum_kernel[(table.n_chunks,)](
        grad, momentum_buffer, out, table.offsets, table.lengths, table.chunk_piece, table.chunk_start,
        table.n_pieces, float(w), float(momentum), NESTEROV=bool(nesterov), W_SMALL=_small(w),
        M_SMALL=_small(momentum), ALIGNED=table.aligned, BLOCK=block, ITERS=iters, num_warps=warps)


# ----------------------------------------------------------------------------- muon_apply
@triton.jit
def _apply_block(p_ptr, u_ptr, offs, mask, factor, alpha, MASKED: tl.constexpr):
    if MASKED:
        p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
        o = tl.load(u_ptr + offs, mask=mask).to(tl.float32)
    else:
        p = tl.load(p_ptr + offs).to(tl.float32)
        o = tl.load(u_ptr + offs).to(tl.float32)
    p = (p * factor).to(p_ptr.dtype.element_ty).to(tl.float32)  # the decayed parameter, rounded as stored
    p = p + alpha * o
    if MASKED:
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty))


@triton.jit
def _apply_kernel(p_base, u_base, table_offsets, lengths, chunk_piece, chunk_start, n_pieces, factors,
                  ALIGNED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    i, start, n, po, uo, _ = _piece(table_offsets, lengths, chunk_piece, chunk_start, n_pieces, 2, ALIGNED, BLOCK)
    factor = tl.load(factors + 2 * i)
    alpha = tl.load(factors + 2 * i + 1)
    p_ptr = p_base + po
    u_ptr = u_base + uo
    if start + BLOCK * ITERS <= n:
        for k in tl.static_range(ITERS):
            offs = start + k * BLOCK + tl.arange(0, BLOCK)
            _apply_block(p_ptr, u_ptr, offs, None, factor, alpha, False)
    else:
        for k in tl.static_range(ITERS):
            offs = start + k * BLOCK + tl.arange(0, BLOCK)
            _apply_block(p_ptr, u_ptr, offs, offs < n, factor, alpha, True)


_factors: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def _factor_table(lr: float, weight_decays, lr_scales, device: torch.device) -> torch.Tensor:
    """Per piece (1 - lr * wd, -lr * scale), computed in double and rounded to float32, on the device (cached:
    a constant learning rate uploads it once)."""
    key = (float(lr), tuple(weight_decays), tuple(lr_scales), device)
    with _lock:
        got = _factors.get(key)
        if got is not None:
            _factors.move_to_end(key)
            return got
    pairs = [v for wd, s in zip(weight_decays, lr_scales, strict=True) for v in (1 - lr * wd, -lr * s)]
    # uploaded without waiting for the device: with a learning-rate schedule the table is new at every step
    table = upload(torch.tensor(pairs, dtype=torch.float64).to(torch.float32), device)
    with _lock:
        _factors[key] = table
        while len(_factors) > _CACHE_SIZE:
            _factors.popitem(last=False)
    return table


def muon_apply(params, updates, *, param_offsets, update_offsets, lengths, lr, weight_decays, lr_scales):
    """One launch for every piece (float32 math); float64 params through the reference."""
    if params.dtype not in _TL or updates.dtype not in _TL:
        ref.muon_apply(params, updates, param_offsets=param_offsets, update_offsets=update_offsets, lengths=lengths,
                       lr=lr, weight_decays=weight_decays, lr_scales=lr_scales)
        return
    _check_device("muon_apply", params)
    block, iters, warps = launch_config(params.dtype)
    table = piece_table((param_offsets, update_offsets), lengths, block * iters, params.device)
    if table is None:
        return
    factors = _factor_table(lr, weight_decays, lr_scales, params.device)
    _apply_kernel[(table.n_chunks,)](
        params, updates, table.offsets, table.lengths, table.chunk_piece, table.chunk_start, table.n_pieces,
        factors, ALIGNED=table.aligned, BLOCK=block, ITERS=iters, num_warps=warps)


__all__ = ["PieceTable", "clear_cache", "muon_apply", "muon_momentum", "piece_table"]
