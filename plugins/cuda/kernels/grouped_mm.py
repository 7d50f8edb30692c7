"""Grouped matmul for expert layers: a Triton kernel, and a ``torch._grouped_mm`` wrapper.

``out[rows of e] = x[rows of e] @ weight[e]`` with ``x`` [T, K] sorted by expert, ``weight``
[E, K, N] and ``offsets`` [E] the cumulative end row of each expert (int32 or int64); rows past
the last offset are zero (the core reference, ``polyaccel.ops.reference.grouped_mm``).

Triton forward (:func:`grouped_mm_forward`): one launch over every (expert, row tile, column
tile). The grid is an upper bound, ``(cdiv(T, BM) + E + 1) * cdiv(N, BN)`` programs; each
program walks the offsets on the device to find its expert and tile, so there is no host sync
and no per-expert launch. Rows past the last offset form one extra group whose tiles store
zeros. Within an expert the row tile varies fastest, so the programs running together share
one strip of the expert's weight in L2. Row indices, offsets and pointer arithmetic are 64-bit.
Loads and stores are masked (never clamped: a clamp on the contiguous dimension would cost
the 16-byte vector loads). Offsets are clamped in the kernel (to ``[previous end, T]``), so
even invalid offsets cannot make it read or write out of bounds; outside CUDA graph capture
they are also validated on the host first (one sync), with the reference's error messages, at
every call: only offsets marked valid by construction (AutoEP's end rows,
:func:`polyaccel.ops.offsets.mark_complete`) skip the read, and only those are converted to int32
for ``torch._grouped_mm`` once per layer (a check or a copy kept for any other tensor could be
bypassed by a write through a NumPy view or a ``.data`` alias, which no version counter sees).

Backward (:data:`grouped_mm`, autograd-aware): ``dx`` is the same grouped kernel on
``grad_out`` and the per-expert transposed weights (a strided view, no copy); ``dw[e] =
x[rows of e]^T @ grad_out[rows of e]`` is a second kernel that reduces over each expert's rows
(an expert without rows gets a zero gradient).

:func:`torch_grouped_mm` runs ``torch._grouped_mm`` (CUTLASS on sm90) where it applies and
zeroes the rows past the last offset, which torch leaves unwritten, in both directions.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from polyaccel.errors import OpArgumentError
from polyaccel.ops import offsets as known_offsets
from polyaccel.ops.reference.grouped_mm import check_grouped_mm_shapes, last_offset
from polyaccel.ops.reference.grouped_mm import grouped_mm as reference_grouped_mm

from ..triton_support import interpreting

_DOT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch settings of the grouped kernels (BM x BN output tile, BK reduction step)."""

    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int


def default_config(dtype: torch.dtype, n: int) -> TileConfig:
    """The forward tile for ``dtype`` and output width ``n`` on a GPU (Hopper-class sizes)."""
    if dtype == torch.float32:
        return TileConfig(64, 128, 32, 4, 3)
    bn = 256 if n >= 256 else 128 if n >= 128 else 64
    return TileConfig(128, bn, 64, 8, 3)


def default_wgrad_config(dtype: torch.dtype) -> TileConfig:
    """The weight-gradient tile: BM x BN of ``dw[e]`` (K x N), BK rows reduced per step."""
    if dtype == torch.float32:
        return TileConfig(64, 64, 32, 4, 3)
    return TileConfig(128, 128, 64, 8, 3)


def _input_precision(dtype: torch.dtype) -> str:
    """fp32 follows torch's matmul setting (tf32 only when the user allowed it); 16-bit is exact."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _upcast_for_dot(dtype: torch.dtype) -> bool:
    """Under the CPU interpreter, bf16 dot operands are upcast to fp32 first.

    The interpreter holds bf16 as raw 16-bit integers and its ``tl.dot`` multiplies those
    integers; fp32 operands give the same result (bf16 products are exact in fp32, the
    accumulator is fp32). On the GPU the bf16 operands go to the tensor cores unchanged.
    """
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def _grouped_mm_kernel(a_ptr, b_ptr, c_ptr, off_ptr, T, K, N, E,
                       s_am, s_ak, s_be, s_bk, s_bn, s_cm, s_cn,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n_tiles = tl.cdiv(N, BN)
    # find this program's group: experts 0..E-1, then group E = rows past the last offset (zeros)
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
    if my_e >= 0:
        local = pid - my_first
        n_idx = local // my_mt  # row tile fastest: neighbours share the weight strip
        m_idx = local % my_mt
        rows = my_start + m_idx * BM + tl.arange(0, BM).to(tl.int64)
        cols = n_idx * BN + tl.arange(0, BN).to(tl.int64)
        ks = tl.arange(0, BK)
        # masks, not clamped indices: a clamp on the contiguous dimension would cost the 16-byte loads
        row_ok = rows < my_end
        col_ok = cols < N
        a_ptrs = a_ptr + rows[:, None] * s_am + ks[None, :] * s_ak
        b_ptrs = b_ptr + tl.maximum(tl.minimum(my_e, E - 1), 0) * s_be + ks[:, None] * s_bk + cols[None, :] * s_bn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_end = tl.where(my_e < E, K, 0)  # the zero group runs no reduction
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
            a_ptrs += BK * s_ak
            b_ptrs += BK * s_bk
        c_mask = row_ok[:, None] & col_ok[None, :]
        tl.store(c_ptr + rows[:, None] * s_cm + cols[None, :] * s_cn, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _grouped_wgrad_kernel(x_ptr, dy_ptr, dw_ptr, off_ptr, T, K, N,
                          s_xm, s_xk, s_dm, s_dn, s_we, s_wk, s_wn,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                          UPCAST: tl.constexpr):
    """dw[e][k tile, n tile] = sum over the rows r of expert e of x[r, k tile]^T dy[r, n tile]."""
    e = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    n_tiles = tl.cdiv(N, BN)
    k_idx = tile // n_tiles
    n_idx = tile % n_tiles
    prev = tl.load(off_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    start = tl.minimum(tl.maximum(prev, 0), T)
    end = tl.minimum(tl.maximum(tl.load(off_ptr + e).to(tl.int64), start), T)
    kk = k_idx * BM + tl.arange(0, BM).to(tl.int64)
    nn = n_idx * BN + tl.arange(0, BN).to(tl.int64)
    kk_ok = kk < K
    nn_ok = nn < N
    r = tl.arange(0, BK).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for r0 in range(start, end, BK):
        rows = r0 + r
        r_ok = rows < end
        xt = tl.load(x_ptr + kk[:, None] * s_xk + rows[None, :] * s_xm, mask=kk_ok[:, None] & r_ok[None, :],
                     other=0.0)
        g = tl.load(dy_ptr + rows[:, None] * s_dm + nn[None, :] * s_dn, mask=r_ok[:, None] & nn_ok[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            g = g.to(tl.float32)
        acc = tl.dot(xt, g, acc, input_precision=PRECISION)
    w_mask = kk_ok[:, None] & nn_ok[None, :]
    tl.store(dw_ptr + e * s_we + kk[:, None] * s_wk + nn[None, :] * s_wn, acc.to(dw_ptr.dtype.element_ty),
             mask=w_mask)


def _check_layout(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> None:
    """The checks that need no device values (safe inside CUDA graph capture): the reference's, and one device."""
    check_grouped_mm_shapes(x, weight, offsets)
    if x.device != weight.device or offsets.device != x.device:
        raise OpArgumentError(f"grouped_mm: x ({x.device}), weight ({weight.device}) and offsets ({offsets.device}) "
                         "must be on one device")


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_args(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """Validate; return int64 offsets and the last offset (see :func:`checked_offsets`)."""
    _check_layout(x, weight, offsets)
    return checked_offsets(offsets, x.shape[0])


def checked_offsets(offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, int | None]:
    """The offsets' value checks alone, for callers that checked the shapes and devices: int64 offsets and the
    last offset. The checks (one host sync, which also gives the last offset; none for offsets already checked
    or valid by construction, :mod:`polyaccel.ops.offsets`) are skipped while capturing, where the last offset
    is None unless known without a read."""
    off64 = offsets.to(torch.int64)
    if _capturing(off64):
        return off64, known_offsets.known_last(off64, rows)
    return off64, last_offset(off64, rows)


#: (weak reference to the int64 offsets converted last, their version counter, their int32 copy)
_last_int32: tuple = (None, -1, None)


def int32_offsets(off64: torch.Tensor) -> torch.Tensor:
    """``off64`` as int32 (what torch._grouped_mm takes), converted once for offsets marked valid by construction
    and unchanged since (a layer's GEMMs share them); any other offsets are converted at every call (a copy kept
    for them would go stale after a write the version counter does not see). Never cached while capturing."""
    global _last_int32
    if _capturing(off64) or not known_offsets.is_marked(off64):
        return off64.to(torch.int32)
    ref, version, off32 = _last_int32
    if ref is None or ref() is not off64 or version != off64._version:
        off32 = off64.to(torch.int32)
        _last_int32 = (weakref.ref(off64), off64._version, off32)
    return off32


def _launch_grouped(a, b, off64, out, cfg: TileConfig | None):
    """out[T, N] = grouped a[T, K] @ b[e] ([E, K, N], any strides)."""
    t, k = a.shape
    e, _, n = b.shape
    if t == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = cfg or default_config(a.dtype, n)
    grid = ((triton.cdiv(t, cfg.bm) + e + 1) * triton.cdiv(n, cfg.bn),)
    _grouped_mm_kernel[grid](
        a, b, out, off64, t, k, n, e,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, EVEN_K=(k % cfg.bk == 0), PRECISION=_input_precision(a.dtype),
        UPCAST=_upcast_for_dot(a.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _check_dtype(x: torch.Tensor) -> None:
    if x.dtype not in _DOT_DTYPES:
        raise OpArgumentError(f"grouped_mm: the Triton kernel takes {_DOT_DTYPES}, got {x.dtype}; "
                         "use polyaccel.ops.override('grouped_mm', 'reference') for other dtypes")


def grouped_mm_forward(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                       config: TileConfig | None = None) -> torch.Tensor:
    """The Triton forward alone (no autograd): ``[T, N]`` in ``x``'s dtype."""
    off64, _ = check_args(x, weight, offsets)
    _check_dtype(x)
    out = torch.empty(x.shape[0], weight.shape[2], dtype=x.dtype, device=x.device)
    return _launch_grouped(x, weight, off64.contiguous(), out, config)


def grouped_mm_weight_grad(x: torch.Tensor, grad_out: torch.Tensor, offsets: torch.Tensor, num_experts: int, *,
                           config: TileConfig | None = None) -> torch.Tensor:
    """``dw[e] = x[rows of e]^T @ grad_out[rows of e]`` as [E, K, N] (offsets already validated, int64)."""
    t, k = x.shape
    n = grad_out.shape[1]
    dw = torch.empty(num_experts, k, n, dtype=x.dtype, device=x.device)
    if num_experts == 0 or k == 0 or n == 0:
        return dw
    if t == 0:
        return dw.zero_()
    cfg = config or default_wgrad_config(x.dtype)
    grid = (num_experts, triton.cdiv(k, cfg.bm) * triton.cdiv(n, cfg.bn))
    _grouped_wgrad_kernel[grid](
        x, grad_out, dw, offsets, t, k, n,
        x.stride(0), x.stride(1), grad_out.stride(0), grad_out.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, PRECISION=_input_precision(x.dtype), UPCAST=_upcast_for_dot(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dw


class _TritonGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, off64, config, wgrad_config):
        out = torch.empty(x.shape[0], weight.shape[2], dtype=x.dtype, device=x.device)
        _launch_grouped(x, weight, off64, out, config)
        ctx.save_for_backward(x, weight, off64)
        ctx.wgrad_config = wgrad_config
        ctx.config = config
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, off64 = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x)
            bwd_cfg = ctx.config or default_config(x.dtype, x.shape[1])
            _launch_grouped(grad_out, weight.transpose(1, 2), off64, dx, bwd_cfg)
        if ctx.needs_input_grad[1]:
            dw = grouped_mm_weight_grad(x, grad_out, off64, weight.shape[0], config=ctx.wgrad_config)
        return dx, dw, None, None, None


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
               config: TileConfig | None = None, wgrad_config: TileConfig | None = None) -> torch.Tensor:
    """The op (Triton, autograd-aware): differentiable in ``x`` and ``weight``.

    dtypes the tensor cores do not take (float64) go to the reference, so the op keeps one
    semantics whatever the dtype.
    """
    off64, _ = check_args(x, weight, offsets)
    if x.dtype not in _DOT_DTYPES:
        return reference_grouped_mm(x, weight, offsets)
    return _TritonGroupedMM.apply(x, weight, off64.contiguous(), config, wgrad_config)


# ----------------------------------------------------------------------------- torch._grouped_mm

def torch_grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> tuple[bool, str]:
    """Whether ``torch._grouped_mm`` takes these inputs (else the wrapper uses the reference)."""
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    if x.dtype != torch.bfloat16:
        return False, f"torch._grouped_mm takes bfloat16 here, got {x.dtype}"
    # CUTLASS needs 16-byte aligned rows: K and N multiples of 8 bf16 elements
    if x.shape[1] % 8 or weight.shape[2] % 8:
        return False, f"K={x.shape[1]} and N={weight.shape[2]} must be multiples of 8 for torch._grouped_mm"
    if x.shape[0] >= 2**31:
        return False, "torch._grouped_mm takes int32 offsets; more than 2**31 - 1 rows need the Triton kernel"
    return True, ""


@triton.jit
def _zero_rows_past_kernel(t_ptr, off_ptr, E, T, N, stride_r, stride_c, BR: tl.constexpr, BN: tl.constexpr):
    """Zero rows ``off[E-1]:T`` of ``t`` [T, N]; tiles wholly before the end store nothing (a masked-off store)."""
    end = tl.load(off_ptr + E - 1).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN).to(tl.int64)
    mask = ((rows >= end) & (rows < T))[:, None] & (cols < N)[None, :]
    zeros = tl.zeros((BR, BN), dtype=t_ptr.dtype.element_ty)
    tl.store(t_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, zeros, mask=mask)


def zero_rows_past_on_device(t: torch.Tensor, off64: torch.Tensor) -> torch.Tensor:
    """Zero the rows of ``t`` [T, N] past ``off64[-1]``, read on the device: what the wrapper does while
    capturing, where the host has no value (a full-tensor masked fill would read and write every row)."""
    T, N = t.shape
    if T == 0 or N == 0:
        return t
    if not off64.numel():
        return t.zero_()
    br, bn = 32, 128
    _zero_rows_past_kernel[(triton.cdiv(T, br), triton.cdiv(N, bn))](t, off64, off64.numel(), T, N, t.stride(0),
                                                                      t.stride(1), BR=br, BN=bn)
    return t


def _zero_rows_past(t: torch.Tensor, off64: torch.Tensor, last: int | None) -> torch.Tensor:
    """Zero the rows of ``t`` past the last offset (torch._grouped_mm leaves them unwritten)."""
    if t.shape[0] == 0:
        return t
    if last is None:  # capturing: no host value, the end read on the device
        return zero_rows_past_on_device(t, off64)
    if last < t.shape[0]:  # (none past the last offset, the usual case: no slice, no launch)
        t[last:].zero_()
    return t


def torch_grouped_product(x, weight, off32, off64, last: int | None) -> torch.Tensor:
    """``x @ weight[e]`` per group through ``torch._grouped_mm``, rows past the last offset zeroed."""
    return _zero_rows_past(torch._grouped_mm(x, weight, offs=off32), off64, last)


def torch_grouped_dgrad(grad_out, weight, off32, off64, last: int | None) -> torch.Tensor:
    """The input gradient of :func:`torch_grouped_product`: ``grad_out @ weight[e]^T`` per group."""
    return torch_grouped_product(grad_out, weight.transpose(-2, -1), off32, off64, last)


def torch_grouped_wgrad(x, grad_out, weight, off32) -> torch.Tensor:
    """The weight gradient of :func:`torch_grouped_product`: ``x[rows of e]^T @ grad_out[rows of e]``."""
    if weight.stride(-2) == 1 and weight.stride(-1) != 1:
        # a transposed view of an [E, N, K] parameter (HF's fused experts): compute the gradient in the
        # parameter's own layout, so accumulating it needs no strided copy
        return torch._grouped_mm(grad_out.t(), x, offs=off32).transpose(-2, -1)
    return torch._grouped_mm(x.t(), grad_out, offs=off32)


class _TorchGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, off32, off64, last):
        ctx.save_for_backward(x, weight, off32, off64)
        ctx.last = last
        return torch_grouped_product(x, weight, off32, off64, last)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, off32, off64 = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch_grouped_dgrad(grad_out, weight, off32, off64, ctx.last)
        if ctx.needs_input_grad[1]:
            dw = torch_grouped_wgrad(x, grad_out, weight, off32)
        return dx, dw, None, None, None


def torch_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The op through ``torch._grouped_mm``, autograd-aware, rows past the last offset zeroed.

    Inputs it does not take (not bf16, unaligned K or N, 2**31 rows) go to the reference. Where no gradient
    is wanted the product is called directly, without an autograd node.
    """
    off64, last = check_args(x, weight, offsets)
    ok, _ = torch_grouped_mm_applies(x, weight)
    if not ok or weight.shape[0] == 0:
        return reference_grouped_mm(x, weight, offsets)
    off32 = int32_offsets(off64)
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return torch_grouped_product(x, weight, off32, off64, last)
    return _TorchGroupedMM.apply(x, weight, off32, off64, last)
