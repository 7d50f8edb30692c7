"""Group-wise quantization: int8, int4 (two per byte) and fp8 e4m3.

The tensor is flattened and cut into consecutive groups of ``group_size`` elements;
each group gets an fp32 scale (and, asymmetric, a uint8 zero point).

* symmetric intB: ``scale = amax / (2**(B-1) - 1)``, ``q = clamp(round(x / scale))``;
  int8 data is ``torch.int8``, int4 data two's-complement nibbles.
* asymmetric intB: the range ``[min(x, 0), max(x, 0)]`` maps to ``[0, 2**B - 1]``,
  ``zero_point = round(-lo / scale)``, ``q = clamp(round(x / scale) + zero_point)``,
  data ``torch.uint8``.
* int4 packs element ``2i`` in the low nibble and ``2i+1`` in the high nibble of byte ``i``.
* fp8 (symmetric only): ``scale = amax / 448``, data ``torch.float8_e4m3fn``.

A group whose values are all zero gets scale 1, so dequantization returns zeros. A group
holding a NaN or an infinity gets a NaN scale (zero point 0, codes 0), so every element of
it dequantizes to NaN: a non-finite input is never turned into finite numbers.
Dequantization is ``(q - zero_point) * scale`` (or ``q * scale``), cast to the original dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import OpArgumentError

MODES = ("int8", "int4", "fp8")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
FP8_MAX = 448.0


@dataclass
class QuantizedTensor:
    """What ``quantize`` returns and ``dequantize`` takes.

    ``data``: the codes, flat (int8 / uint8 / float8_e4m3fn; int4 packed two per uint8);
    ``scales``: fp32, one per group; ``zero_points``: uint8 per group, None when symmetric;
    ``mode``, ``group_size``, and the input's ``shape`` and ``dtype``.
    """

    data: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor | None
    mode: str
    group_size: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def symmetric(self) -> bool:
        return self.zero_points is None

    @property
    def num_groups(self) -> int:
        return self.scales.numel()


def qmax(mode: str, symmetric: bool) -> int:
    bits = 8 if mode == "int8" else 4
    return 2 ** (bits - 1) - 1 if symmetric else 2**bits - 1


def check_quantize_args(x: torch.Tensor, mode: str, group_size: int, symmetric: bool) -> None:
    if mode not in MODES:
        raise OpArgumentError(f"quantize: mode {mode!r} is not one of {MODES}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize: expected a tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise OpArgumentError(f"quantize: input dtype {x.dtype} is not a float type; use one of {FLOAT_DTYPES}")
    if x.numel() == 0:
        raise OpArgumentError("quantize: the input is empty; there is nothing to quantize")
    if not x.is_contiguous():
        raise OpArgumentError("quantize: the input is not contiguous; call .contiguous() first")
    if not isinstance(group_size, int) or group_size <= 0:
        raise OpArgumentError(f"quantize: group_size must be a positive int, got {group_size!r}")
    if x.numel() % group_size:
        raise OpArgumentError(
            f"quantize: group_size {group_size} does not divide the {x.numel()} elements of the input; "
            "pad the input or pick a divisor"
        )
    if mode == "int4" and group_size % 2:
        raise OpArgumentError(
            f"quantize: int4 packs two values per byte, so group_size must be even (got {group_size})")
    if mode == "fp8" and not symmetric:
        raise OpArgumentError("quantize: fp8 is symmetric only; pass symmetric=True")


def check_dequantize_args(qt) -> None:
    """What ``dequantize`` needs of a ``QuantizedTensor``: one scale (and zero point) per group, consistent data."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"dequantize: expected a QuantizedTensor, got {type(qt).__name__}")
    if qt.mode not in MODES:
        raise OpArgumentError(f"dequantize: mode {qt.mode!r} is not one of {MODES}")
    n = 1
    for s in qt.shape:
        n *= int(s)
    if not isinstance(qt.group_size, int) or qt.group_size <= 0 or n % qt.group_size:
        raise OpArgumentError(f"dequantize: group_size {qt.group_size!r} does not divide the {n} elements of "
                              f"shape {tuple(qt.shape)}; the QuantizedTensor is inconsistent")
    groups = n // qt.group_size
    if qt.scales.numel() != groups:
        raise OpArgumentError(f"dequantize: scales has {qt.scales.numel()} entries but shape {tuple(qt.shape)} with "
                              f"group_size {qt.group_size} has {groups} groups; the QuantizedTensor is inconsistent "
                              "(one scale per group)")
    if qt.zero_points is not None and qt.zero_points.numel() != groups:
        raise OpArgumentError(f"dequantize: zero_points has {qt.zero_points.numel()} entries but there are "
                              f"{groups} groups; the QuantizedTensor is inconsistent (one zero point per group, "
                              "or None when symmetric)")
    per_byte = 2 if qt.mode == "int4" else 1
    if qt.data.numel() * per_byte != n:
        raise OpArgumentError(f"dequantize: data has {qt.data.numel()} entries, which do not hold the {n} elements "
                              f"of shape {tuple(qt.shape)} in mode {qt.mode!r}; the QuantizedTensor is inconsistent")


def _nonfinite_groups(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each group holds a NaN or an infinity, the groups with those groups zeroed)."""
    bad = ~torch.isfinite(g).all(dim=1)
    return bad, torch.where(bad[:, None], torch.zeros_like(g), g)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int values in [-8, 15] (flattened, even length) two per byte, low nibble first."""
    q = q.to(torch.int16).reshape(-1, 2) & 0xF
    return (q[:, 0] | (q[:, 1] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    p = packed.to(torch.int16)
    lo, hi = p & 0xF, (p >> 4) & 0xF
    out = torch.stack([lo, hi], dim=-1).reshape(-1)
    if signed:
        out = torch.where(out >= 8, out - 16, out)
    return out


def _ieee_div(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor`` correctly rounded on every device.

    Dividing by a Python scalar lets CUDA multiply by the reciprocal instead (one ulp off
    in a few percent of groups); dividing by a tensor is a true division everywhere.
    """
    return t / torch.full_like(t, divisor)


def quantize(x: torch.Tensor, mode: str = "int8", group_size: int = 128, symmetric: bool = True) -> QuantizedTensor:
    """Group-wise quantization of `x`; returns a `QuantizedTensor`. `x` is not modified.

    `polyaccel.ops.quantize` validates the arguments (`check_quantize_args`) and calls a
    builder's function as `fn(x, mode=mode, group_size=group_size, symmetric=symmetric)`.
    `x` is a contiguous, non-empty float tensor (fp32, fp16, bf16 or fp64) whose element
    count `group_size` divides; `mode` is "int8", "int4" (even `group_size`) or "fp8"
    (symmetric only). `x` is flattened and cut into groups of `group_size` elements; each
    group gets an fp32 scale and, when asymmetric, a uint8 zero point; math in fp32:

        symmetric intB (B = 8 or 4):
            qmax = 2**(B-1) - 1;  scale = max(|x|) / qmax
            q = clamp(round(x / scale), -qmax, qmax)
        asymmetric intB:
            lo, hi = min(min(x), 0), max(max(x), 0);  scale = (hi - lo) / (2**B - 1)
            zero_point = clamp(round(-lo / scale), 0, 2**B - 1)
            q = clamp(round(x / scale) + zero_point, 0, 2**B - 1)
        fp8:
            scale = max(|x|) / 448;  q = clamp(x / scale, -448, 448) cast to float8_e4m3fn
        a group whose values are all zero gets scale 1
        a group holding any NaN or +-Inf gets scale NaN, zero point 0 and codes 0, so
        every element of that group dequantizes to NaN; other groups are unaffected

    Wire format (fixed, compared exactly): `data` is flat `torch.int8` (symmetric int8),
    `torch.uint8` (asymmetric int8; int4 packed two per byte, element 2i in the low
    nibble, two's complement when symmetric) or `torch.float8_e4m3fn`; `scales` fp32 with
    one entry per group; `zero_points` uint8 per group or None; `shape` and `dtype` of `x`.
    """
    check_quantize_args(x, mode, group_size, symmetric)
    bad, g = _nonfinite_groups(x.reshape(-1, group_size).float())
    if mode == "fp8":
        amax = g.abs().amax(dim=1)
        scale = torch.where(amax > 0, _ieee_div(amax, FP8_MAX), torch.ones_like(amax))
        data = (g / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(-1)
        return QuantizedTensor(data, _nan_where(bad, scale), None, mode, group_size, x.shape, x.dtype)
    top = qmax(mode, symmetric)
    if symmetric:
        amax = g.abs().amax(dim=1)
        scale = torch.where(amax > 0, _ieee_div(amax, top), torch.ones_like(amax))
        q = torch.round(g / scale[:, None]).clamp(-top, top)
        zp = None
    else:
        lo = g.amin(dim=1).clamp(max=0)
        hi = g.amax(dim=1).clamp(min=0)
        span = hi - lo
        scale = torch.where(span > 0, _ieee_div(span, top), torch.ones_like(span))
        zp = torch.round(-lo / scale).clamp(0, top)
        q = (torch.round(g / scale[:, None]) + zp[:, None]).clamp(0, top)
        zp = zp.to(torch.uint8)
    q = q.reshape(-1)
    if mode == "int4":
        data = pack_int4(q)
    else:
        data = q.to(torch.int8 if symmetric else torch.uint8)
    return QuantizedTensor(data, _nan_where(bad, scale), zp, mode, group_size, x.shape, x.dtype)


def _nan_where(bad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.where(bad, torch.full_like(scale, float("nan")), scale)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor a `QuantizedTensor` stands for: a new tensor of `qt.shape`.

    Called as `fn(qt, dtype=dtype)`. Per group, in fp32: `(q - zero_point) * scale`
    (symmetric: `q * scale`), reshaped to `qt.shape` and cast to `dtype`, or to `qt.dtype`
    when `dtype` is None. `qt`'s tensors are on the device; nothing is modified in place.
    A NaN scale (a group that held a NaN or an infinity) makes its whole group NaN.
    `qt.scales` (and `qt.zero_points`) must hold exactly one entry per group and `qt.data`
    the codes of `qt.shape`'s elements, else `OpArgumentError` (never a silent broadcast);
    `polyaccel.ops.dequantize` checks this before any builder runs (`check_dequantize_args`).
    """
    check_dequantize_args(qt)
    dtype = dtype or qt.dtype
    if qt.mode == "int4":
        q = unpack_int4(qt.data, signed=qt.symmetric).float()
    else:
        q = qt.data.float()
    q = q.reshape(-1, qt.group_size)
    if qt.zero_points is not None:
        q = q - qt.zero_points.float()[:, None]
    return (q * qt.scales[:, None]).reshape(qt.shape).to(dtype)
