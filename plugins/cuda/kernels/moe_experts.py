"""Fused expert MLP kernels: ``moe_gate_up`` and ``moe_down_combine`` (core references in
``polyaccel.ops.reference.moe_experts``).

Forward, ``moe_gate_up`` (:func:`gate_up_forward`): one grouped GEMM launch whose A operand is
``x`` read through ``tok`` (the token of each routed row), so the tokens are never copied into
expert order; each program holds two accumulators, the gate columns ``c`` and the up columns
``F + c`` of the same output tile, and its epilogue rounds both to the input dtype (as the
unfused path's GEMM output is rounded), writes them (``gu``, saved for backward) and writes
``silu(gate) * up``. The tile walk over the offsets is the one of ``grouped_mm``'s kernel: on
the device, no host sync, int64 rows and pointers, masked loads, a zero group past the last
offset.

Forward, ``moe_down_combine``: the down grouped GEMM; with k = 1 (the index is a permutation
of tokens: ep > 1's way home, top-1 routers) its epilogue scales each row by its router weight
and stores it straight into its token's row (one pass, no atomics). With k > 1 the k slots of
a token lie in different experts' tiles: the GEMM writes its rows and ``gather_sum``'s kernel
sums them (one read; fp32 atomics into a [T, H] buffer were no cheaper in the earlier combine
measurements, and not deterministic).

Backward, ``moe_down_combine`` (:func:`_down_dgrad_kernel`): ``d_h = w * (grad_out[tok] @
w2^T)``, with grad_out's rows gathered on load and the router weight applied in the epilogue,
which also writes ``dot(h[r], grad_out[tok[r]] @ w2^T)`` per column tile: the router weight's
gradient is ``dot(y[r], grad_out[tok[r]])`` and ``y = h @ w2``, so ``y`` is never kept (the
unfused path keeps it). ``d_w2 = h^T (w * grad_out[tok])`` gathers and scales on load.

Backward, ``moe_gate_up``: SwiGLU's backward kernel (into the halves of one ``[N, 2F]``
tensor), ``d_x`` as ``grouped_mm`` of that with ``w1^T`` (through the op registry: the
fastest plain grouped GEMM there) summed per token by ``gather_sum``'s kernel, and ``d_w1 =
x[tok]^T d_gu`` gathering on load.

The weight-gradient kernel is the slow part (H200: 180-360 TF/s against about 700 for
``torch._grouped_mm``, ``benchmarks/moe_tiles_gpu.py --wgrad``). Gathering the rows first and
handing them to ``torch._grouped_mm`` was measured too: forward + backward 0.78-0.92x of the unfused
chain instead of 0.66-0.92x, but the copies (and CUTLASS's own of a transposed operand) raised the
peak above the unfused path's (8.1 GB against 5.2 at E = 8, 32k tokens, top-8), so the in-place
kernel stays: the fused path's one advantage is its lower peak.

Saved for backward: ``x`` (the caller's, kept anyway), ``tok``, ``gu`` [N, 2F] and ``h`` [N,
F]; the unfused path also keeps the routed copy of ``x`` and the down GEMM's output, each
[N, H], so the peak is lower.

Tiles: on a GPU, ``triton.autotune`` over :data:`GATE_UP_CONFIGS` etc., keyed by the widths and
a rows-per-expert class (:func:`shape_class`); under the interpreter (or with ``config=``) one
:class:`TileConfig`.

Dtypes: bf16 and fp16 run the kernels; other dtypes take the unfused path through the op
registry (:func:`fused_applies` is the rule, and the place a measured shape rule goes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from polyaccel import ops
from polyaccel.ops.reference.moe_experts import (
    check_moe_down_combine_shapes,
    check_moe_gate_up_shapes,
    routed_tokens,
)
from polyaccel.ops.reference.swiglu import halves_of

from ..triton_support import interpreting
from .gather_sum import gather_sum_forward
from .grouped_mm import TileConfig, _input_precision, _upcast_for_dot, checked_offsets
from .swiglu import swiglu_backward

#: the dtypes the fused kernels serve (fp32 and fp64 take the unfused path)
FUSED_DTYPES = (torch.bfloat16, torch.float16)


def fused_applies(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the fused kernels run for this call (else the unfused path through the op registry)."""
    if dtype not in FUSED_DTYPES:
        return False, f"the fused kernels take {FUSED_DTYPES}, got {dtype}"
    return True, ""


def shape_class(rows: int, experts: int) -> int:
    """The autotuner's shape-class key: rows per expert, rounded up to a power of two (capped)."""
    return min(triton.next_power_of_2(max(rows // max(experts, 1), 1)), 1 << 14)


def _configs(shapes):
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s) for bm, bn, bk, w, s in shapes]


#: the gate/up tile holds two accumulators (gate and up), so its BN is half a plain GEMM's
GATE_UP_CONFIGS = _configs([(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 64, 64, 8, 3), (64, 128, 64, 4, 4),
                            (128, 128, 32, 8, 4)])
#: the down-projection backward's tiles share one BN: its per-row partial dots have one column per column tile
DGRAD_BN = 128
DGRAD_CONFIGS = _configs([(128, DGRAD_BN, 64, 4, 3), (128, DGRAD_BN, 64, 8, 3), (64, DGRAD_BN, 64, 4, 4),
                          (128, DGRAD_BN, 32, 8, 4)])
DOWN_CONFIGS = _configs([(128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (64, 128, 64, 4, 4)])
WGRAD_CONFIGS = _configs([(128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 128, 32, 8, 4), (64, 128, 64, 4, 3)])
#: the one tile used under the interpreter when none is given
INTERPRET_CONFIG = TileConfig(32, 32, 32, 4, 1)


def _even_k(args) -> bool:
    return args["K"] % args["BK"] == 0


@triton.jit
def _tile_of(pid, off_ptr, T, E, n_tiles, BM: tl.constexpr):
    """(expert or E for the zero group or -1, its first row, its end row, its first tile, its row tiles)."""
    zero = pid * 0
    start = zero
    first_tile = zero
    my_e = zero - 1
    my_start = zero
    my_end = zero
    my_first = zero
    my_mt = zero + 1
    for e in range(0, E + 1):
        end = tl.load(off_ptr + e, mask=e < E, other=T).to(tl.int64)
        end = tl.minimum(tl.maximum(end, start), T)
        m_tiles = tl.cdiv(end - start, BM)
        tiles = m_tiles * n_tiles
        hit = (pid >= first_tile) & (pid < first_tile + tiles)
        my_e = tl.where(hit, e, my_e)
        my_start = tl.where(hit, start, my_start)
        my_end = tl.where(hit, end, my_end)
        my_first = tl.where(hit, first_tile, my_first)
        my_mt = tl.where(hit, m_tiles, my_mt)
        first_tile += tiles
        start = end
    return my_e, my_start, my_end, my_first, my_mt


@triton.jit
def _gate_up_fwd_kernel(x_ptr, tok_ptr, w_ptr, gu_ptr, h_ptr, off_ptr, N, K, F, E,
                        s_xm, s_xk, s_we, s_wk, s_wn, SHAPE_CLASS,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n_tiles = tl.cdiv(F, BN)
    my_e, my_start, my_end, my_first, _ = _tile_of(pid, off_ptr, N, E, n_tiles, BM)
    if my_e >= 0:
        local = pid - my_first
        n_idx = local % n_tiles  # column tile fastest: neighbours share the (gathered) row tile in L2
        m_idx = local // n_tiles
        rows = my_start + m_idx * BM + tl.arange(0, BM).to(tl.int64)
        cols = n_idx * BN + tl.arange(0, BN).to(tl.int64)
        ks = tl.arange(0, BK)
        row_ok = rows < my_end
        col_ok = cols < F
        src = tl.load(tok_ptr + rows, mask=row_ok, other=0)  # the token row of x each routed row reads
        a_ptrs = x_ptr + src[:, None] * s_xm + ks[None, :] * s_xk
        we = tl.maximum(tl.minimum(my_e, E - 1), 0)
        g_ptrs = w_ptr + we * s_we + ks[:, None] * s_wk + cols[None, :] * s_wn
        u_ptrs = g_ptrs + F * s_wn
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        k_end = tl.where(my_e < E, K, 0)  # the zero group runs no reduction
        for k in range(0, k_end, BK):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                bg = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
                bu = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (k + ks) < K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                bg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                bu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                bg = bg.to(tl.float32)
                bu = bu.to(tl.float32)
            acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
            a_ptrs += BK * s_xk
            g_ptrs += BK * s_wk
            u_ptrs += BK * s_wk
        # the epilogue: round like the unfused GEMM's output, then SwiGLU in fp32 (the reference's order)
        g = acc_g.to(gu_ptr.dtype.element_ty)
        u = acc_u.to(gu_ptr.dtype.element_ty)
        gf = g.to(tl.float32)
        hv = gf * tl.sigmoid(gf) * u.to(tl.float32)
        mask = row_ok[:, None] & col_ok[None, :]
        gu_ptrs = gu_ptr + rows[:, None] * (2 * F) + cols[None, :]
        tl.store(gu_ptrs, g, mask=mask)
        tl.store(gu_ptrs + F, u, mask=mask)
        tl.store(h_ptr + rows[:, None] * F + cols[None, :], hv.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_fwd_kernel(h_ptr, w_ptr, out_ptr, dst_ptr, scale_ptr, off_ptr, N, K, H, E,
                     s_hm, s_hk, s_we, s_wk, s_wn, SHAPE_CLASS,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                     HAS_DST: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """out[dst[r]] = scale[r] * (h[r] @ w[e]) (each part optional), the product rounded before the scale."""
    pid = tl.program_id(0).to(tl.int64)
    n_tiles = tl.cdiv(H, BN)
    my_e, my_start, my_end, my_first, _ = _tile_of(pid, off_ptr, N, E, n_tiles, BM)
    if my_e >= 0:
        local = pid - my_first
        n_idx = local % n_tiles
        m_idx = local // n_tiles
        rows = my_start + m_idx * BM + tl.arange(0, BM).to(tl.int64)
        cols = n_idx * BN + tl.arange(0, BN).to(tl.int64)
        ks = tl.arange(0, BK)
        row_ok = rows < my_end
        col_ok = cols < H
        a_ptrs = h_ptr + rows[:, None] * s_hm + ks[None, :] * s_hk
        we = tl.maximum(tl.minimum(my_e, E - 1), 0)
        b_ptrs = w_ptr + we * s_we + ks[:, None] * s_wk + cols[None, :] * s_wn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_end = tl.where(my_e < E, K, 0)
        for k in range(0, k_end, BK):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (k + ks) < K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BK * s_hk
            b_ptrs += BK * s_wk
        y = acc.to(out_ptr.dtype.element_ty)
        if HAS_SCALE:
            s = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
            y = (y.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty)
        if HAS_DST:
            orow = tl.load(dst_ptr + rows, mask=row_ok, other=0)
        else:
            orow = rows
        tl.store(out_ptr + orow[:, None] * H + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_dgrad_kernel(g_ptr, tok_ptr, w_ptr, dh_ptr, scale_ptr, h_ptr, part_ptr, off_ptr, N, K, F, E,
                       s_gm, s_gk, s_we, s_wk, s_wn, s_part, SHAPE_CLASS,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                       HAS_SCALE: tl.constexpr, NEED_DW: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr):
    """acc = g[tok[r]] @ w[e] (w: w2[e]^T, a strided view); dh[r] = scale[r] * acc; part[r, tile] = dot(h[r], acc)."""
    pid = tl.program_id(0).to(tl.int64)
    n_tiles = tl.cdiv(F, BN)
    my_e, my_start, my_end, my_first, _ = _tile_of(pid, off_ptr, N, E, n_tiles, BM)
    if my_e >= 0:
        local = pid - my_first
        n_idx = local % n_tiles
        m_idx = local // n_tiles
        rows = my_start + m_idx * BM + tl.arange(0, BM).to(tl.int64)
        cols = n_idx * BN + tl.arange(0, BN).to(tl.int64)
        ks = tl.arange(0, BK)
        row_ok = rows < my_end
        col_ok = cols < F
        src = tl.load(tok_ptr + rows, mask=row_ok, other=0)
        a_ptrs = g_ptr + src[:, None] * s_gm + ks[None, :] * s_gk
        we = tl.maximum(tl.minimum(my_e, E - 1), 0)
        b_ptrs = w_ptr + we * s_we + ks[:, None] * s_wk + cols[None, :] * s_wn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_end = tl.where(my_e < E, K, 0)
        for k in range(0, k_end, BK):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (k + ks) < K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BK * s_gk
            b_ptrs += BK * s_wk
        mask = row_ok[:, None] & col_ok[None, :]
        dh = acc
        if HAS_SCALE:
            s = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
            dh = acc * s[:, None]
        tl.store(dh_ptr + rows[:, None] * F + cols[None, :], dh.to(dh_ptr.dtype.element_ty), mask=mask)
        if NEED_DW:
            hv = tl.load(h_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(part_ptr + rows * s_part + n_idx, tl.sum(hv * acc, axis=1), mask=row_ok)


@triton.jit
def _gathered_wgrad_kernel(a_ptr, a_idx_ptr, b_ptr, b_idx_ptr, b_scale_ptr, dw_ptr, off_ptr, N, K, M,
                           s_am, s_ak, s_bm, s_bn, s_we, s_wk, s_wn, SHAPE_CLASS,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           A_IDX: tl.constexpr, B_IDX: tl.constexpr, B_SCALE: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """dw[e] = a[ia[r]]^T (scale[r] * b[ib[r]]) over the rows r of expert e ([K, M]; the scaled rows rounded)."""
    e = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    n_tiles = tl.cdiv(M, BN)
    k_idx = tile // n_tiles
    n_idx = tile % n_tiles
    prev = tl.load(off_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    start = tl.minimum(tl.maximum(prev, 0), N)
    end = tl.minimum(tl.maximum(tl.load(off_ptr + e).to(tl.int64), start), N)
    kk = k_idx * BM + tl.arange(0, BM).to(tl.int64)
    nn = n_idx * BN + tl.arange(0, BN).to(tl.int64)
    kk_ok = kk < K
    nn_ok = nn < M
    r = tl.arange(0, BK).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for r0 in range(start, end, BK):
        rows = r0 + r
        r_ok = rows < end
        if A_IDX:
            ar = tl.load(a_idx_ptr + rows, mask=r_ok, other=0)
        else:
            ar = rows
        if B_IDX:
            br = tl.load(b_idx_ptr + rows, mask=r_ok, other=0)
        else:
            br = rows
        at = tl.load(a_ptr + kk[:, None] * s_ak + ar[None, :] * s_am, mask=kk_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_ptr + br[:, None] * s_bm + nn[None, :] * s_bn, mask=r_ok[:, None] & nn_ok[None, :], other=0.0)
        if B_SCALE:
            s = tl.load(b_scale_ptr + rows, mask=r_ok, other=0.0)
            b = (b.to(tl.float32) * s[:, None]).to(b_ptr.dtype.element_ty)
        if UPCAST:
            at = at.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(at, b, acc, input_precision=PRECISION)
    tl.store(dw_ptr + e * s_we + kk[:, None] * s_wk + nn[None, :] * s_wn, acc.to(dw_ptr.dtype.element_ty),
             mask=kk_ok[:, None] & nn_ok[None, :])


_gate_up_tuned = triton.autotune(GATE_UP_CONFIGS, key=["K", "F", "SHAPE_CLASS"])(
    triton.heuristics({"EVEN_K": _even_k})(_gate_up_fwd_kernel))
_down_tuned = triton.autotune(DOWN_CONFIGS, key=["K", "H", "SHAPE_CLASS", "HAS_DST", "HAS_SCALE"])(
    triton.heuristics({"EVEN_K": _even_k})(_down_fwd_kernel))
_dgrad_tuned = triton.autotune(DGRAD_CONFIGS, key=["K", "F", "SHAPE_CLASS", "HAS_SCALE", "NEED_DW"])(
    triton.heuristics({"EVEN_K": _even_k})(_down_dgrad_kernel))
_wgrad_tuned = triton.autotune(WGRAD_CONFIGS, key=["K", "M", "SHAPE_CLASS", "A_IDX", "B_IDX", "B_SCALE"])(
    _gathered_wgrad_kernel)


# ----------------------------------------------------------------------------- launchers
def _launch(kernel, tuned, grid_of, config: TileConfig | None, *args, even_k: int | None = None, **meta):
    """Run ``kernel`` with one tile (``config``, or the interpreter's) or ``tuned`` (the autotuner) on a GPU."""
    if config is None and interpreting():
        config = INTERPRET_CONFIG
    if config is None:
        tuned[lambda m: grid_of(m["BM"], m["BN"])](*args, **meta)
        return
    if even_k is not None:
        meta["EVEN_K"] = even_k % config.bk == 0
    kernel[grid_of(config.bm, config.bn)](*args, BM=config.bm, BN=config.bn, BK=config.bk,
                                          num_warps=config.num_warps, num_stages=config.num_stages, **meta)


def _grouped_grid(n_rows: int, experts: int, n_cols: int):
    return lambda bm, bn: ((triton.cdiv(n_rows, bm) + experts + 1) * triton.cdiv(n_cols, bn),)


def gate_up_forward(x, tok, w1, off64, *, config: TileConfig | None = None):
    """(gu [N, 2F], h [N, F]) for routed rows ``x[tok]`` (``tok`` int64 [N], ``off64`` int64 [E])."""
    n, e, k, f2 = tok.shape[0], w1.shape[0], w1.shape[1], w1.shape[2]
    f = f2 // 2
    gu = torch.empty(n, f2, dtype=x.dtype, device=x.device)
    h = torch.empty(n, f, dtype=x.dtype, device=x.device)
    if n == 0 or f == 0:
        return gu, h
    if k == 0:
        gu.zero_()
        return gu, h.zero_()
    _launch(_gate_up_fwd_kernel, _gate_up_tuned, _grouped_grid(n, e, f), config,
            x, tok, w1, gu, h, off64, n, k, f, e,
            x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2), shape_class(n, e),
            even_k=k, PRECISION=_input_precision(x.dtype), UPCAST=_upcast_for_dot(x.dtype))
    return gu, h


def down_forward(h, w2, off64, *, dst=None, scale=None, out_rows: int | None = None,
                 config: TileConfig | None = None):
    """``out[dst[r]] = scale[r] * (h[r] @ w2[e])`` ([out_rows, H]; without ``dst`` row r goes to row r)."""
    n, e, k, hh = h.shape[0], w2.shape[0], w2.shape[1], w2.shape[2]
    out = torch.empty(n if out_rows is None else out_rows, hh, dtype=h.dtype, device=h.device)
    if n == 0 or hh == 0:
        return out
    if k == 0:
        return out.zero_()
    _launch(_down_fwd_kernel, _down_tuned, _grouped_grid(n, e, hh), config,
            h, w2, out, dst if dst is not None else off64, scale if scale is not None else h, off64, n, k, hh, e,
            h.stride(0), h.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), shape_class(n, e),
            even_k=k, HAS_DST=dst is not None, HAS_SCALE=scale is not None,
            PRECISION=_input_precision(h.dtype), UPCAST=_upcast_for_dot(h.dtype))
    return out


def down_dgrad(grad_out, tok, w2, off64, h, scale, need_dw: bool, *, config: TileConfig | None = None):
    """(d_h [N, F], per-row dot(h[r], grad_out[tok[r]] @ w2[e]^T) [N] fp32 or None)."""
    n, e, f, hh = h.shape[0], w2.shape[0], w2.shape[1], w2.shape[2]
    dh = torch.empty(n, f, dtype=h.dtype, device=h.device)
    if n == 0 or f == 0:
        return dh, (torch.zeros(n, dtype=torch.float32, device=h.device) if need_dw else None)
    if hh == 0:
        return dh.zero_(), (torch.zeros(n, dtype=torch.float32, device=h.device) if need_dw else None)
    wt = w2.transpose(1, 2)  # [E, H, F] view
    # the partial dots: one column per output column tile (every config of the autotuner has BN = DGRAD_BN, so
    # each run writes every entry and none is left from another config's run)
    cfg = config or (INTERPRET_CONFIG if interpreting() else None)
    bn = cfg.bn if cfg is not None else DGRAD_BN
    part = torch.empty(n, triton.cdiv(f, bn), dtype=torch.float32, device=h.device) if need_dw else None
    _launch(_down_dgrad_kernel, _dgrad_tuned, _grouped_grid(n, e, f), config,
            grad_out, tok, wt, dh, scale if scale is not None else h, h, part if part is not None else dh, off64,
            n, hh, f, e, grad_out.stride(0), grad_out.stride(1), wt.stride(0), wt.stride(1), wt.stride(2),
            part.stride(0) if part is not None else 0, shape_class(n, e),
            even_k=hh, HAS_SCALE=scale is not None, NEED_DW=need_dw,
            PRECISION=_input_precision(h.dtype), UPCAST=_upcast_for_dot(h.dtype))
    return dh, (part.sum(dim=1) if need_dw else None)


def gathered_wgrad(a, b, off64, experts: int, *, a_idx=None, b_idx=None, b_scale=None, like=None,
                   config: TileConfig | None = None):
    """``dw[e] = a[a_idx[r]]^T (b_scale[r] * b[b_idx[r]])`` over expert e's rows r, as [E, K, M].

    With ``like`` (the weight), ``dw`` takes its strides, so the gradient of a transposed view of
    an [E, M, K] parameter is written in the parameter's own layout (no strided copy to accumulate).
    """
    rows = (a_idx if a_idx is not None else b_idx if b_idx is not None else a).shape[0]
    k, m = a.shape[1], b.shape[1]
    if like is not None and like.shape == (experts, k, m) and (like.is_contiguous()
                                                               or like.transpose(1, 2).is_contiguous()):
        dw = torch.empty_like(like, dtype=a.dtype)
    else:
        dw = torch.empty(experts, k, m, dtype=a.dtype, device=a.device)
    if experts == 0 or k == 0 or m == 0:
        return dw
    if rows == 0:
        return dw.zero_()
    cfg = config or (INTERPRET_CONFIG if interpreting() else None)
    args = (a, a_idx if a_idx is not None else off64, b, b_idx if b_idx is not None else off64,
            b_scale if b_scale is not None else a, dw, off64, rows, k, m,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
            shape_class(rows, experts))
    meta = dict(A_IDX=a_idx is not None, B_IDX=b_idx is not None, B_SCALE=b_scale is not None,
                PRECISION=_input_precision(a.dtype), UPCAST=_upcast_for_dot(a.dtype))
    if cfg is None:
        _wgrad_tuned[lambda mm: (experts, triton.cdiv(k, mm["BM"]) * triton.cdiv(m, mm["BN"]))](*args, **meta)
    else:
        _gathered_wgrad_kernel[(experts, triton.cdiv(k, cfg.bm) * triton.cdiv(m, cfg.bn))](
            *args, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **meta)
    return dw


def slot_positions(index: torch.Tensor) -> torch.Tensor:
    """``dst`` [N] int64: the flat slot ``t * k + j`` of routed row ``index[t, j]``."""
    dst = torch.empty(index.numel(), dtype=torch.int64, device=index.device)
    dst[index.reshape(-1).long()] = torch.arange(index.numel(), device=index.device)
    return dst


def row_weights(index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The router weight of each routed row, fp32 [N] (``s[index[t, j]] = weights[t, j]``)."""
    s = torch.empty(index.numel(), dtype=torch.float32, device=index.device)
    s[index.reshape(-1).long()] = weights.reshape(-1).float()
    return s


# ----------------------------------------------------------------------------- autograd
class _GateUp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, index, tok, off64, config):
        gu, h = gate_up_forward(x, tok, w1, off64, config=config)
        ctx.save_for_backward(x, w1, index, tok, off64)
        # kept on ctx rather than saved, so the backward can let it go once SwiGLU's gradient is taken (the
        # peak of the backward then holds gu or its gradient, not both; gu is no output, so no reference cycle)
        ctx.gu = gu
        ctx.config = config
        return h

    @staticmethod
    def backward(ctx, dh):
        x, w1, index, tok, off64 = ctx.saved_tensors
        gu, ctx.gu = ctx.gu, None
        f = w1.shape[2] // 2
        d_gate, d_up = swiglu_backward(dh.contiguous(), gu[:, :f], gu[:, f:])
        del gu
        d_gu = halves_of(d_gate, d_up)
        if d_gu is None:
            d_gu = torch.cat((d_gate, d_up), dim=-1)
        del d_gate, d_up
        dx = dw1 = None
        if ctx.needs_input_grad[1]:
            dw1 = gathered_wgrad(x, d_gu, off64, w1.shape[0], a_idx=tok, like=w1, config=ctx.config)
        if ctx.needs_input_grad[0]:
            d_routed = ops.grouped_mm(d_gu, w1.transpose(1, 2), off64)
            del d_gu
            dx = gather_sum_forward(d_routed, index, None)
        return dx, dw1, None, None, None, None


class _DownCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w2, weights, index, tok, off64, config):
        T, k = index.shape
        scale = row_weights(index, weights) if weights is not None else None
        if k == 1:  # a permutation: each row straight to its token, weighted in the epilogue
            out = down_forward(h, w2, off64, dst=slot_positions(index), scale=scale, out_rows=T, config=config)
        else:
            out = gather_sum_forward(down_forward(h, w2, off64, config=config), index, weights)
        ctx.save_for_backward(h, w2, weights, index, tok, off64, scale)
        ctx.config = config
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, w2, weights, index, tok, off64, scale = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        need_dw = weights is not None and ctx.needs_input_grad[2]
        dh = dw2 = d_weights = None
        if ctx.needs_input_grad[0] or need_dw:
            dh, dots = down_dgrad(grad_out, tok, w2, off64, h, scale, need_dw, config=ctx.config)
            if need_dw:
                d_weights = dots.index_select(0, index.reshape(-1).long()).view(index.shape).to(weights.dtype)
        if ctx.needs_input_grad[1]:
            dw2 = gathered_wgrad(h, grad_out, off64, w2.shape[0], b_idx=tok, b_scale=scale, like=w2,
                                 config=ctx.config)
        return (dh if ctx.needs_input_grad[0] else None), dw2, d_weights, None, None, None, None


# ----------------------------------------------------------------------------- the ops
def unfused_gate_up(x, index, w1, offsets):
    """The unfused path through the op registry (the fastest plain builders there)."""
    gate, up = ops.grouped_mm(x.index_select(0, routed_tokens(index)), w1, offsets).chunk(2, dim=-1)
    return ops.swiglu(gate, up)


def moe_gate_up(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                config: TileConfig | None = None) -> torch.Tensor:
    """The op (fused for bf16/fp16, else the unfused path through the registry), autograd-aware."""
    check_moe_gate_up_shapes(x, index, weight, offsets)
    ok, _ = fused_applies(x.dtype)
    if not ok:
        return unfused_gate_up(x, index, weight, offsets)
    off64, _ = checked_offsets(offsets, index.numel())
    return _GateUp.apply(x, weight, index, routed_tokens(index), off64.contiguous(), config)


def moe_down_combine(h: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor,
                     weights: torch.Tensor | None = None, *, config: TileConfig | None = None) -> torch.Tensor:
    """The op (fused for bf16/fp16, else the unfused path through the registry), autograd-aware."""
    check_moe_down_combine_shapes(h, weight, offsets, index, weights)
    ok, _ = fused_applies(h.dtype)
    if not ok:
        return ops.gather_sum(ops.grouped_mm(h, weight, offsets), index, weights)
    off64, _ = checked_offsets(offsets, h.shape[0])
    return _DownCombine.apply(h, weight, weights, index, routed_tokens(index), off64.contiguous(), config)
