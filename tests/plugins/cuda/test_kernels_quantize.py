"""Triton quantize/dequantize under TRITON_INTERPRET=1 against the core reference (bit-exact) and float64."""

from __future__ import annotations

import importlib

import pytest
import torch
from polyaccel.errors import Unsupported
from polyaccel.plugins.cuda.kernels import quantize as kq

ref = importlib.import_module("polyaccel.ops.reference.quantize")

MODES = [("int8", True), ("int8", False), ("int4", True), ("int4", False), ("fp8", True)]
#: one group size per class: the smallest, a non power of two, the common one, the largest
GROUP_SIZES = [32, 96, 128, 1024]


def _input(num_groups: int, group_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Fresh random groups with varied ranges, one-sided groups, an outlier and one all-zero group."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_groups, group_size, generator=gen, dtype=torch.float64)
    x *= torch.exp(torch.randn(num_groups, 1, generator=gen, dtype=torch.float64) * 2)
    x[1 % num_groups] = x[1 % num_groups].abs()  # a positive-only group (asymmetric zero point 0)
    x[2 % num_groups] = -x[2 % num_groups].abs()  # a negative-only group
    x[num_groups - 1, group_size // 3] *= 50  # an outlier
    x[0] = 0.0  # all zero: scale 1
    return x.to(dtype)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("mode,symmetric", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_reference_bit_for_bit(mode, symmetric, group_size, dtype):
    num_groups = 5 if group_size < 1024 else 3  # odd: the last program is partly masked
    x = _input(num_groups, group_size, dtype, seed=group_size + len(mode) + symmetric)
    got = kq.quantize(x, mode, group_size, symmetric)
    want = ref.quantize(x, mode, group_size, symmetric)
    if not _same_bytes(got.data, want.data):
        diff = int((got.data.view(torch.uint8) != want.data.view(torch.uint8)).sum())
        raise AssertionError(f"{mode} data differs from the reference in {diff} bytes")
    assert torch.equal(got.scales, want.scales) and got.scales.dtype == torch.float32
    assert got.scales[0].item() == 1.0  # the all-zero group
    if symmetric:
        assert got.zero_points is None
    else:
        assert got.zero_points.dtype == torch.uint8 and torch.equal(got.zero_points, want.zero_points)
    assert (got.mode, got.group_size, got.shape, got.dtype) == (mode, group_size, x.shape, dtype)


@pytest.mark.parametrize("group_size", [32, 96, 1024])
@pytest.mark.parametrize("mode,symmetric", MODES)
def test_round_trip_error_is_within_half_a_step_in_float64(mode, symmetric, group_size):
    """Independent of the reference: dequantize(quantize(x)) is within half a quantization step of x."""
    x = _input(3, group_size, torch.float32, seed=7 * group_size + symmetric)
    qt = kq.quantize(x, mode, group_size, symmetric)
    back = kq.dequantize(qt, torch.float64).reshape(3, group_size)
    xd = x.double().reshape(3, group_size)
    err = (back - xd).abs()
    scale = qt.scales.double()[:, None]
    if mode == "fp8":  # 3 mantissa bits: half a step is amax * 2**-4 relative, plus subnormal spacing
        bound = xd.abs() * 2.0**-4 + scale * 2.0**-10
    else:
        bound = scale * (0.5 + 1e-6)
    assert bool((err <= bound).all()), f"max error {float((err - bound).max()):.3e} over the bound"
    assert bool((back[0] == 0).all())


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("mode,symmetric", MODES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_float64(mode, symmetric, group_size, out_dtype):
    x = _input(3, group_size, torch.float32, seed=group_size * 3 + symmetric)
    qt = ref.quantize(x, mode, group_size, symmetric)
    got = kq.dequantize(qt, out_dtype)
    assert got.dtype == out_dtype and got.shape == x.shape
    if mode == "int4":
        q = ref.unpack_int4(qt.data, signed=symmetric).double()
    else:
        q = qt.data.double()
    q = q.reshape(-1, group_size)
    if not symmetric:
        q = q - qt.zero_points.double()[:, None]
    want = (q * qt.scales.double()[:, None]).reshape(x.shape)
    err = (got.double() - want).abs()
    if out_dtype == torch.float32:
        assert bool((err <= want.abs() * 2.0**-24).all())
    else:  # the interpreter truncates fp32 -> bf16: one bf16 ulp of slack
        ulp = torch.where(want == 0, torch.zeros_like(want), 2.0 ** (torch.floor(torch.log2(want.abs())) - 7))
        assert bool((err <= ulp).all()), f"max error {float(err.max()):.3e}"


def test_default_dtype_and_multidim_shape_round_trip():
    x = torch.randn(4, 6, 32, dtype=torch.bfloat16)
    qt = kq.quantize(x, "int4", 64, symmetric=False)
    assert qt.data.numel() == x.numel() // 2 and qt.scales.numel() == x.numel() // 64
    back = kq.dequantize(qt)
    assert back.shape == x.shape and back.dtype == torch.bfloat16
    ref_back = ref.dequantize(ref.quantize(x, "int4", 64, symmetric=False))
    ulp = 2.0 ** (torch.floor(torch.log2(ref_back.double().abs().clamp_min(1e-30))) - 7)
    assert bool(((back.double() - ref_back.double()).abs() <= ulp).all())


def test_float64_and_float16_inputs_match_reference():
    for dtype in (torch.float64, torch.float16):
        x = _input(3, 64, dtype, seed=11)
        got, want = kq.quantize(x, "int8", 64), ref.quantize(x, "int8", 64)
        assert torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales)


def test_many_programs_cover_every_group():
    """More groups than one program holds (32 rows of 128): no group is skipped or written twice."""
    x = _input(70, 128, torch.float32, seed=3)
    got, want = kq.quantize(x, "int8", 128), ref.quantize(x, "int8", 128)
    assert torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "int3"}, "mode"),
    ({"group_size": 100}, "does not divide"),
    ({"mode": "int4", "group_size": 33, "n": 66}, "even"),
    ({"mode": "fp8", "symmetric": False}, "symmetric only"),
])
def test_bad_arguments_raise_clear_errors(kwargs, match):
    n = kwargs.pop("n", 256)
    with pytest.raises(ValueError, match=match):
        kq.quantize(torch.randn(n), **{"mode": "int8", "group_size": 128, **kwargs})


def test_inconsistent_quantized_tensor_is_rejected():
    qt = kq.quantize(torch.randn(256), "int8", 128)
    qt.scales = qt.scales[:1]
    with pytest.raises(ValueError, match="inconsistent"):
        kq.dequantize(qt)


def test_fp8_on_older_gpus_raises_unsupported_naming_the_plugin(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(Unsupported, match="fp8") as info:
        kq._require_fp8(torch.device("cuda", 0), "quantize")
    assert info.value.plugin == "cuda" and "override" in info.value.hint
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    kq._require_fp8(torch.device("cuda", 0), "quantize")  # sm90: fine


def test_fast_division_path_matches_reference(monkeypatch):
    """The GPU's division (reciprocal + Markstein correction) and its fallback for tiny scales.

    40 groups of 128 are two programs of 32 rows: the first takes the fast path, the second
    holds a group whose scale is below 2**-100 and falls back to ``div_rn``. Under the
    interpreter ``tl.fma`` is not fused, so this exercises the code paths rather than proving
    the GPU's rounding (the GPU check does that, against the CPU reference).
    """
    monkeypatch.setattr(kq, "FAST_DIV", True)
    x = _input(40, 128, torch.float32, seed=21)
    x[35] *= 1e-36
    for mode, symmetric in MODES:
        got, want = kq.quantize(x, mode, 128, symmetric), ref.quantize(x, mode, 128, symmetric)
        assert _same_bytes(got.data, want.data) and torch.equal(got.scales, want.scales), mode


def _round_fp32(value) -> float:
    """A Fraction rounded to the nearest fp32, ties to even (exact, for the rare cases checked below)."""
    from fractions import Fraction

    import numpy as np

    f = np.float32(float(value))
    cands = [f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))]
    return float(min(cands, key=lambda c: (abs(Fraction(float(c)) - value),
                                           int(np.frombuffer(np.float32(c).tobytes(), np.uint32)[0]) & 1)))


def test_fma_division_gives_the_ieee_quotient():
    """The arithmetic the GPU's fast division relies on (Markstein): with y = RN(1/s), q = RN(x*y),
    r = fma(q, -s, x) exact, RN(fma(r, y, q)) is RN(x/s). Checked on fresh quantizer-like operands,
    emulating the fused operations in float64 and, where that double-rounds, exactly in rationals."""
    from fractions import Fraction

    n = 400_000
    gen = torch.Generator().manual_seed(1234)
    amax = torch.rand(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 8 - 4) + 1e-6
    for top in (127, 7, 255, 15, 448):
        s = amax.float() / top
        x = ((torch.rand(n, generator=gen) * 2 - 1) * amax).bfloat16().float()
        y = torch.ones(n) / s
        q = x * y
        r = (q.double() * -s.double() + x.double()).float()
        v = (r.double() * y.double() + q.double()).float()
        want = x / s
        for i in (v != want).nonzero().flatten().tolist():
            xi, si, yi, qi = (Fraction(float(t[i])) for t in (x, s, y, q))
            r_exact = xi - qi * si
            assert Fraction(_round_fp32(r_exact)) == r_exact, "the remainder must be exact"
            assert _round_fp32(Fraction(_round_fp32(r_exact)) * yi + qi) == want[i].item()


@pytest.mark.parametrize("mode,symmetric", MODES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_group_holding_nan_or_inf_gets_a_nan_scale_like_the_reference(mode, symmetric, bad):
    x = _input(5, 96, torch.float32, seed=3)
    x[2, 40] = bad
    x[4, 95] = float("nan")
    got = kq.quantize(x, mode, 96, symmetric)
    want = ref.quantize(x, mode, 96, symmetric)
    assert got.scales.isnan().tolist() == [False, False, True, False, True]
    assert torch.equal(got.scales.isnan(), want.scales.isnan())
    assert torch.equal(got.scales.nan_to_num(), want.scales.nan_to_num())
    assert _same_bytes(got.data, want.data)
    if not symmetric:
        assert torch.equal(got.zero_points, want.zero_points) and int(got.zero_points[2]) == 0
    back = kq.dequantize(got, torch.float32)
    assert bool(back[[2, 4]].isnan().all()) and bool(back[[0, 1, 3]].isfinite().all())
    assert torch.equal(back[[0, 1, 3]], ref.dequantize(want, torch.float32)[[0, 1, 3]])


def test_dequantize_refuses_a_scale_count_that_is_not_the_group_count():
    qt = kq.quantize(torch.randn(256), "int8", 64, False)
    qt.zero_points = qt.zero_points[:1]
    with pytest.raises(ValueError, match="zero_points has 1 entries"):
        kq.dequantize(qt)
