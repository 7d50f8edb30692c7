"""Quantize/dequantize: error bounds per mode, exact int4 packing, clear errors."""

import polyaccel
import pytest
import torch
from polyaccel.ops import reference as ref
from polyaccel.ops.reference.quantize import pack_int4, unpack_int4

MODES = [("int8", True), ("int8", False), ("int4", True), ("int4", False)]


@pytest.mark.parametrize("mode,symmetric", MODES)
@pytest.mark.parametrize("group_size", [32, 128, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_within_half_a_step(mode, symmetric, group_size, dtype):
    x = (torch.randn(4, 2048) * torch.rand(4, 1) * 5).to(dtype)
    qt = polyaccel.ops.quantize(x, mode=mode, group_size=group_size, symmetric=symmetric)
    back = polyaccel.ops.dequantize(qt, dtype=torch.float64)
    xs = x.double().reshape(-1, group_size)
    if symmetric:
        top = 127 if mode == "int8" else 7
        step = xs.abs().amax(1) / top
    else:
        top = 255 if mode == "int8" else 15
        step = (xs.amax(1).clamp(min=0) - xs.amin(1).clamp(max=0)) / top
    err = (back.reshape(-1, group_size) - xs).abs().amax(1)
    # half a step, plus fp32 rounding of x / scale (a few ulps of values up to `top`)
    assert bool((err <= step * (0.5 + top * 2**-21) + 1e-12).all()), float((err / step).max())
    assert qt.data.dtype == (torch.int8 if (mode == "int8" and symmetric) else torch.uint8)
    assert qt.data.numel() == x.numel() // (2 if mode == "int4" else 1)
    assert qt.scales.dtype == torch.float32 and qt.scales.numel() == x.numel() // group_size
    assert (qt.zero_points is None) == symmetric
    assert polyaccel.ops.dequantize(qt).dtype == dtype


def test_fp8_round_trip_relative_bound():
    x = torch.randn(8, 512) * 3
    qt = polyaccel.ops.quantize(x, mode="fp8", group_size=128)
    assert qt.data.dtype == torch.float8_e4m3fn
    back = polyaccel.ops.dequantize(qt, dtype=torch.float64)
    scale = qt.scales.double().repeat_interleave(128).reshape(x.shape)
    bound = x.double().abs() * 2**-4 + scale * 2**-10  # half an e4m3 ulp, subnormal floor
    assert bool(((back - x.double()).abs() <= bound * (1 + 1e-6)).all())


def test_all_zero_group_gets_unit_scale_and_zero_output():
    x = torch.zeros(256)
    x[128:] = torch.randn(128)
    for mode, sym in MODES:
        qt = ref.quantize(x, mode, 128, sym)
        assert qt.scales[0] == 1.0
        assert bool((ref.dequantize(qt)[:128] == 0).all())


def test_int4_packing_is_exact_and_low_nibble_first():
    q = torch.randint(-8, 8, (64,))
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.numel() == 32
    assert int(packed[0]) == (int(q[0]) & 0xF) | ((int(q[1]) & 0xF) << 4)
    assert torch.equal(unpack_int4(packed, signed=True), q.to(torch.int16))
    u = torch.randint(0, 16, (64,))
    assert torch.equal(unpack_int4(pack_int4(u), signed=False), u.to(torch.int16))


def test_bad_inputs_give_clear_errors():
    x = torch.randn(10, 10)
    with pytest.raises(ValueError, match="does not divide"):
        polyaccel.ops.quantize(x, group_size=32)
    with pytest.raises(ValueError, match="not a float type"):
        polyaccel.ops.quantize(torch.ones(64, dtype=torch.int32), group_size=32)
    with pytest.raises(ValueError, match="not contiguous"):
        polyaccel.ops.quantize(torch.randn(64, 64).t(), group_size=32)
    with pytest.raises(ValueError, match="empty"):
        polyaccel.ops.quantize(torch.randn(0), group_size=32)
    with pytest.raises(ValueError, match="mode"):
        polyaccel.ops.quantize(torch.randn(64), mode="int3", group_size=32)
    with pytest.raises(ValueError, match="even"):
        polyaccel.ops.quantize(torch.randn(66), mode="int4", group_size=33)
    with pytest.raises(ValueError, match="symmetric only"):
        polyaccel.ops.quantize(torch.randn(64), mode="fp8", group_size=32, symmetric=False)
    with pytest.raises(TypeError, match="QuantizedTensor"):
        polyaccel.ops.dequantize(torch.randn(4))


QUANT_MODES = [*MODES, ("fp8", True)]


@pytest.mark.parametrize("mode,symmetric", QUANT_MODES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_group_holding_nan_or_inf_dequantizes_to_nan_and_others_are_unaffected(mode, symmetric, bad):
    x = torch.randn(4, 64) * 3
    x[1, 17] = bad
    x[3, 0] = float("nan")
    qt = polyaccel.ops.quantize(x, mode=mode, group_size=64, symmetric=symmetric)
    assert qt.scales.isnan().tolist() == [False, True, False, True]
    if not symmetric:
        assert qt.zero_points[1] == 0 and qt.zero_points[3] == 0
    back = polyaccel.ops.dequantize(qt, dtype=torch.float64)
    assert bool(back[[1, 3]].isnan().all())
    finite = polyaccel.ops.quantize(x[[0, 2]].contiguous(), mode=mode, group_size=64, symmetric=symmetric)
    assert torch.equal(back[[0, 2]], polyaccel.ops.dequantize(finite, dtype=torch.float64))
    assert torch.equal(qt.scales[[0, 2]], finite.scales)


@pytest.mark.parametrize("mode,symmetric", QUANT_MODES)
def test_dequantize_refuses_a_scale_or_zero_point_count_that_is_not_the_group_count(mode, symmetric):
    x = torch.randn(256)
    for fn in (polyaccel.ops.dequantize, ref.dequantize):
        qt = polyaccel.ops.quantize(x, mode=mode, group_size=64, symmetric=symmetric)
        qt.scales = qt.scales[:1]  # one scale would broadcast over all four groups
        with pytest.raises(polyaccel.errors.OpArgumentError, match="scales has 1 entries.*4 groups"):
            fn(qt)
        if not symmetric:
            qt = polyaccel.ops.quantize(x, mode=mode, group_size=64, symmetric=symmetric)
            qt.zero_points = qt.zero_points[:1]
            with pytest.raises(polyaccel.errors.OpArgumentError, match="zero_points has 1 entries"):
                fn(qt)
