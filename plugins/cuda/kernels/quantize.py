"""Triton group-wise quantize / dequantize: int8, int4 (two per byte) and fp8 e4m3.

The semantics are the core reference's (``polyaccel.ops.reference.quantize``), bit for bit:
fp32 scales, ``amax / qmax`` (symmetric) or ``(max(x, 0) - min(x, 0)) / qmax`` with a uint8
zero point (asymmetric), scale 1 for an all-zero group, a NaN scale with zero point 0 and
codes 0 for a group holding a NaN or an infinity, round half to even, int4 element ``2i``
in the low nibble of byte ``i``, fp8 e4m3 with ``scale = amax / 448``.

One program handles ``ROWS`` consecutive groups as a ``[ROWS, GROUP_P2]`` tile (``GROUP_P2`` is
the group size rounded up to a power of two; the extra columns are masked), so any group size
works and a group never straddles two programs. Program ids and offsets are 64-bit.

Divisions give the IEEE round-to-nearest quotient, as torch's on the CPU (Triton's plain ``/``
on fp32 is the approximate ``div.full`` on NVIDIA GPUs, which would move values across a
rounding boundary now and then; torch's CUDA division by a Python scalar multiplies by the
reciprocal, so the reference run on a GPU can differ from its CPU run by one ulp of scale).
On the GPU the per-element division is a reciprocal per group plus an FMA correction and the
rounding one ``cvt.rni`` (see ``_div_rows`` / ``_round_to_int``); under the CPU interpreter,
which has no fused FMA and no libdevice, the same kernel uses ``div_rn`` and the fp32
"magic number" rounding ``(v + 1.5 * 2**23) - 1.5 * 2**23`` (exact round-half-to-even for
``|v| < 2**22``; quantized values are at most 255 in magnitude). The module flags
``FAST_DIV`` / ``NATIVE_ROUND`` force either variant.

fp8: Triton converts to and from e4m3 only on compute capability 8.9 and newer. On an older
GPU ``quantize(..., mode="fp8")`` and the fp8 ``dequantize`` raise ``polyaccel.Unsupported``
naming the cuda plugin (the hint says how to use the reference instead); on ROCm fp8 runs
only where the accelerator lists ``float8_e4m3fn`` among its fp8 dtypes (not MI300's fnuz
formats). int8 and int4 work on every GPU Triton supports.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from polyaccel.errors import OpArgumentError, Unsupported
from polyaccel.ops.reference.quantize import (
    FP8_MAX,
    QuantizedTensor,
    check_dequantize_args,
    check_quantize_args,
    qmax,
)
from triton.language.extra import libdevice

from ..triton_support import interpreting

MODE_INT8, MODE_INT4, MODE_FP8 = 0, 1, 2
_MODE_IDS = {"int8": MODE_INT8, "int4": MODE_INT4, "fp8": MODE_FP8}
#: elements one program handles (ROWS * GROUP_P2); a power of two
BLOCK_ELEMS = 4096
#: warps per program; None: 8 for full tiles, 4 for smaller ones
NUM_WARPS: int | None = None
#: division method: None picks the fused-multiply-add division on the GPU and ``div_rn`` under the
#: interpreter (see ``_div_rows``); True/False force one (both give the IEEE quotient on the GPU)
FAST_DIV: bool | None = None
#: rounding: None picks ``libdevice.float2int_rn`` (one ``cvt.rni``) on the GPU and the fp32 trick under
#: the interpreter, which has no libdevice; both round half to even
NATIVE_ROUND: bool | None = None
#: oldest compute capability with hardware e4m3 conversions in Triton
FP8_MIN_CAPABILITY = (8, 9)
_PLUGIN = "cuda"


@triton.jit
def _round_half_even(v):
    # exact for |v| < 2**22; fp32 adds are not reassociated (no fast-math)
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _round_to_e4m3(v):
    """Round fp32 ``v`` (``|v| <= 448``) to the nearest e4m3 value, ties to even, staying in fp32.

    The cast to e4m3 that follows is then exact. Triton's CPU interpreter rounds fp8 casts
    wrongly (no carry into the exponent: 126.8 becomes 64), so the kernel does not rely on it;
    on the GPU this is a few integer ops per element of a memory-bound kernel.
    """
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    exp = tl.maximum((((bits >> 23) & 0xFF).to(tl.int32) - 127), -6)  # e4m3 subnormals share 2**-6's step
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: step 2**(exp-3)
    inv_step = ((127 - (exp - 3)) << 23).to(tl.float32, bitcast=True)  # exact powers of two: no division
    r = _round_half_even(mag * inv_step) * step
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _div_rows(x, scale, FAST_DIV: tl.constexpr):
    """``x / scale[:, None]`` rounded to nearest (IEEE), as torch's CPU division.

    FAST_DIV (GPU): one correctly rounded reciprocal ``y = RN(1 / s)`` per row, then per
    element Markstein's correction ``q = x * y; r = fma(q, -s, x); fma(r, y, q)``, which is
    the correctly rounded quotient (three instructions instead of ``div.rn``'s subroutine).
    It needs no overflow of ``1 / s`` and no underflow of the remainder: a tile holding a
    row with a scale below 2**-100 takes ``div_rn`` instead (one branch per program). The
    CPU interpreter does not fuse ``tl.fma``, so by default it runs ``div_rn``.
    """
    if FAST_DIV:
        if tl.min(scale, axis=0) >= 7.888609052210118e-31:  # 2**-100
            y = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
            q = x * y[:, None]
            r = tl.fma(q, -scale[:, None], x)
            v = tl.fma(r, y[:, None], q)
        else:
            v = tl.math.div_rn(x, scale[:, None])
    else:
        v = tl.math.div_rn(x, scale[:, None])
    return v


@triton.jit
def _round_to_int(v, NATIVE_ROUND: tl.constexpr):
    """Round half to even and convert to int32: one ``cvt.rni`` on the GPU, the fp32 trick elsewhere."""
    if NATIVE_ROUND:
        return libdevice.float2int_rn(v)
    else:
        return _round_half_even(v).to(tl.int32)


@triton.jit
def _quantize_kernel(x_ptr, data_ptr, scale_ptr, zp_ptr, num_groups,
                     GROUP: tl.constexpr, GROUP_P2: tl.constexpr, ROWS: tl.constexpr,
                     MODE: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr, FAST_DIV: tl.constexpr,
                     NATIVE_ROUND: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, GROUP_P2)
    row_ok = rows < num_groups
    mask = row_ok[:, None] & (cols[None, :] < GROUP)
    x = tl.load(x_ptr + rows[:, None] * GROUP + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # a group holding a NaN or an infinity (NaN fails every comparison) is quantized as zeros, then
    # gets a NaN scale: it dequantizes to NaN, never to finite numbers
    finite = tl.abs(x) <= 3.4028234663852886e38
    bad = tl.min(finite.to(tl.int32), axis=1) == 0
    x = tl.where(bad[:, None], 0.0, x)
    nan = tl.full([ROWS], 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)

    if MODE == 2:  # fp8 e4m3, symmetric
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        v = _round_to_e4m3(tl.minimum(tl.maximum(_div_rows(x, scale, FAST_DIV), -448.0), 448.0))
        tl.store(data_ptr + rows[:, None] * GROUP + cols[None, :], v.to(tl.float8e4nv), mask=mask)
        tl.store(scale_ptr + rows, tl.where(bad, nan, scale), mask=row_ok)
    else:
        if SYMMETRIC:
            amax = tl.max(tl.abs(x), axis=1)
            scale = tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)
            qi = _round_to_int(_div_rows(x, scale, FAST_DIV), NATIVE_ROUND)
            qi = tl.minimum(tl.maximum(qi, -QMAX), QMAX)
        else:
            # padding columns hold 0, which the clamps to min(x, 0) / max(x, 0) absorb
            lo = tl.minimum(tl.min(x, axis=1), 0.0)
            hi = tl.maximum(tl.max(x, axis=1), 0.0)
            span = hi - lo
            scale = tl.where(span > 0, tl.math.div_rn(span, QMAX), 1.0)
            zp = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(-lo, scale)), 0.0), QMAX).to(tl.int32)
            qi = _round_to_int(_div_rows(x, scale, FAST_DIV), NATIVE_ROUND) + zp[:, None]
            qi = tl.minimum(tl.maximum(qi, 0), QMAX)
            tl.store(zp_ptr + rows, zp.to(tl.uint8), mask=row_ok)
        tl.store(scale_ptr + rows, tl.where(bad, nan, scale), mask=row_ok)
        if MODE == 0:
            if SYMMETRIC:
                qb = qi.to(tl.int8)
            else:
                qb = qi.to(tl.uint8)
            tl.store(data_ptr + rows[:, None] * GROUP + cols[None, :], qb, mask=mask)
        else:  # int4: element 2i -> low nibble, 2i+1 -> high nibble of byte i
            lo_q, hi_q = tl.split(tl.reshape(qi, (ROWS, GROUP_P2 // 2, 2)))
            packed = ((lo_q & 0xF) | ((hi_q & 0xF) << 4)).to(tl.uint8)
            pairs = tl.arange(0, GROUP_P2 // 2)
            pmask = row_ok[:, None] & (pairs[None, :] < GROUP // 2)
            tl.store(data_ptr + rows[:, None] * (GROUP // 2) + pairs[None, :], packed, mask=pmask)


@triton.jit
def _dequantize_kernel(data_ptr, scale_ptr, zp_ptr, out_ptr, num_groups,
                       GROUP: tl.constexpr, GROUP_P2: tl.constexpr, ROWS: tl.constexpr,
                       MODE: tl.constexpr, SYMMETRIC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, GROUP_P2)
    row_ok = rows < num_groups
    mask = row_ok[:, None] & (cols[None, :] < GROUP)
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=1.0)
    if MODE == 1:
        pairs = tl.arange(0, GROUP_P2 // 2)
        pmask = row_ok[:, None] & (pairs[None, :] < GROUP // 2)
        p = tl.load(data_ptr + rows[:, None] * (GROUP // 2) + pairs[None, :], mask=pmask, other=0).to(tl.int32)
        lo_q = p & 0xF
        hi_q = (p >> 4) & 0xF
        if SYMMETRIC:
            lo_q = tl.where(lo_q >= 8, lo_q - 16, lo_q)
            hi_q = tl.where(hi_q >= 8, hi_q - 16, hi_q)
        q = tl.reshape(tl.join(lo_q, hi_q), (ROWS, GROUP_P2)).to(tl.float32)
    else:
        # masked lanes are never stored, so they need no fill value (fp8 has no integer 0 to cast)
        q = tl.load(data_ptr + rows[:, None] * GROUP + cols[None, :], mask=mask).to(tl.float32)
    if not SYMMETRIC:
        zp = tl.load(zp_ptr + rows, mask=row_ok, other=0).to(tl.float32)
        q = q - zp[:, None]
    out = q * scale[:, None]
    tl.store(out_ptr + rows[:, None] * GROUP + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _tile(group_size: int) -> tuple[int, int]:
    """(GROUP_P2, ROWS) for a group size: a power-of-two tile of about BLOCK_ELEMS elements."""
    group_p2 = triton.next_power_of_2(group_size)
    rows = max(1, BLOCK_ELEMS // group_p2)
    return group_p2, rows


def _num_warps(group_p2: int, rows: int) -> int:
    if NUM_WARPS is not None:
        return NUM_WARPS
    return 8 if group_p2 * rows >= 4096 else 4


def _require_fp8(device: torch.device, what: str) -> None:
    """Raise ``Unsupported`` where the GPU has no e4m3fn conversions (CPU tensors: the interpreter, fine)."""
    if device.type != "cuda":
        return
    if getattr(torch.version, "hip", None):
        from polyaccel.selection import accelerator_for_device_type

        acc = accelerator_for_device_type("cuda")
        dtypes = acc.fp8_dtypes() if acc is not None and hasattr(acc, "fp8_dtypes") else ()
        if torch.float8_e4m3fn not in dtypes:
            raise Unsupported(
                acc.name if acc is not None else "rocm", f"fp8 e4m3fn {what} on this GPU",
                f"its fp8 formats are {[str(d) for d in dtypes] or 'none'}; use mode='int8', or "
                "polyaccel.ops.override('quantize', 'reference') for the torch version",
            )
        return
    cap = tuple(torch.cuda.get_device_capability(device))
    if cap < FP8_MIN_CAPABILITY:
        raise Unsupported(
            _PLUGIN, f"fp8 (e4m3) {what} on compute capability {cap[0]}.{cap[1]}",
            f"Triton converts to e4m3 only on {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} and newer; "
            "use mode='int8', or polyaccel.ops.override('quantize', 'reference') for the torch version",
        )


def quantize(x: torch.Tensor, mode: str = "int8", group_size: int = 128, symmetric: bool = True) -> QuantizedTensor:
    """Quantize ``x`` group-wise; same arguments and result as the reference ``quantize``."""
    check_quantize_args(x, mode, group_size, symmetric)
    if mode == "fp8":
        _require_fp8(x.device, "quantize")
        symmetric = True
    n = x.numel()
    num_groups = n // group_size
    if mode == "fp8":
        data = torch.empty(n, dtype=torch.float8_e4m3fn, device=x.device)
    elif mode == "int4":
        data = torch.empty(n // 2, dtype=torch.uint8, device=x.device)
    else:
        data = torch.empty(n, dtype=torch.int8 if symmetric else torch.uint8, device=x.device)
    scales = torch.empty(num_groups, dtype=torch.float32, device=x.device)
    zero_points = None if symmetric else torch.empty(num_groups, dtype=torch.uint8, device=x.device)
    group_p2, rows = _tile(group_size)
    top = qmax(mode, symmetric) if mode != "fp8" else int(FP8_MAX)
    grid = (triton.cdiv(num_groups, rows),)
    _quantize_kernel[grid](
        x, data, scales, zero_points if zero_points is not None else scales, num_groups,
        GROUP=group_size, GROUP_P2=group_p2, ROWS=rows, MODE=_MODE_IDS[mode], SYMMETRIC=symmetric,
        QMAX=top, FAST_DIV=(not interpreting()) if FAST_DIV is None else FAST_DIV,
        NATIVE_ROUND=(not interpreting()) if NATIVE_ROUND is None else NATIVE_ROUND,
        num_warps=_num_warps(group_p2, rows),
    )
    return QuantizedTensor(data, scales, zero_points, mode, group_size, x.shape, x.dtype)


def _check_quantized(qt: QuantizedTensor) -> None:
    check_dequantize_args(qt)  # one scale / zero point per group, data matching the shape
    if qt.mode not in _MODE_IDS:
        raise OpArgumentError(f"dequantize: mode {qt.mode!r} is not one of {tuple(_MODE_IDS)}")
    n = 1
    for s in qt.shape:
        n *= int(s)
    if n % qt.group_size:
        raise OpArgumentError(f"dequantize: group_size {qt.group_size} does not divide the {n} elements of shape "
                         f"{tuple(qt.shape)}")
    per_byte = 2 if qt.mode == "int4" else 1
    if qt.data.numel() * per_byte != n or qt.scales.numel() != n // qt.group_size:
        raise OpArgumentError(
            f"dequantize: data has {qt.data.numel()} entries and scales {qt.scales.numel()} for shape "
            f"{tuple(qt.shape)} and group_size {qt.group_size}; the QuantizedTensor is inconsistent"
        )
    if qt.scales.dtype != torch.float32:
        raise OpArgumentError(f"dequantize: scales must be float32, got {qt.scales.dtype}")
    for name in ("data", "scales", "zero_points"):
        t = getattr(qt, name)
        if t is not None and (t.device != qt.data.device or not t.is_contiguous()):
            raise OpArgumentError(f"dequantize: {name} must be contiguous and on {qt.data.device}")


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(q - zero_point) * scale`` cast to ``dtype`` (default: the quantized tensor's dtype)."""
    _check_quantized(qt)
    dtype = dtype or qt.dtype
    if qt.mode == "fp8":
        _require_fp8(qt.data.device, "dequantize")
    out = torch.empty(qt.shape, dtype=dtype, device=qt.data.device)
    if out.numel() == 0:
        return out
    num_groups = qt.scales.numel()
    group_p2, rows = _tile(qt.group_size)
    grid = (triton.cdiv(num_groups, rows),)
    zp = qt.zero_points if qt.zero_points is not None else qt.scales
    _dequantize_kernel[grid](
        qt.data, qt.scales, zp, out, num_groups,
        GROUP=qt.group_size, GROUP_P2=group_p2, ROWS=rows, MODE=_MODE_IDS[qt.mode], SYMMETRIC=qt.symmetric,
        num_warps=_num_warps(group_p2, rows),
    )
    return out
