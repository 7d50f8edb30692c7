"""npu op builders resolved for device type "npu", run on emulated (CPU) tensors, against the reference."""

from __future__ import annotations

import pytest
import torch
from polyaccel import ops
from polyaccel.ops.reference import optimizers as ref_optim
from polyaccel.ops.reference.quantize import quantize as reference_quantize
from polyaccel.testing.emulation import emulate
from polyaccel.testing.numerics import assert_close_to_reference

SHAPES = [(33,), (7, 5), (0,), (129,)]


def _state(param_dtype, state_dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def make(dtype, scale=1.0, positive=False):
        out = []
        for s in SHAPES:
            t = torch.randn(s, generator=gen) * scale
            out.append((t.abs() if positive else t).to(dtype))
        return out

    return (make(param_dtype), make(param_dtype, 0.1), make(state_dtype, 0.05), make(state_dtype, 0.01, True))


def _as64(lists):
    """Reference copies: float64 for fp32 lists; 16-bit params keep their dtype so the reference
    rounds them back after every step exactly as the op must (its math is fp32 either way)."""
    return [[t.double() if t.dtype == torch.float32 else t.clone() for t in lst] for lst in lists]


def _check(got_lists, want_lists, what):
    for name, got, want in zip(("param", "exp_avg", "exp_avg_sq", "extra"), got_lists, want_lists, strict=False):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_close_to_reference(g, w, g.dtype, f"{what}: {name}[{i}]")


@pytest.fixture
def npu_runtime():
    with emulate("npu") as rt:
        yield rt


class _Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_fused_adam_matches_reference_through_torchs_fused_interface(npu_runtime, monkeypatch, adam_w_mode,
                                                                      bias_correction, dtypes):
    spies = {name: _Spy(getattr(torch, name)) for name in ("_fused_adam_", "_fused_adamw_")}
    for name, spy in spies.items():
        monkeypatch.setattr(torch, name, spy)
    fn = ops.resolve("fused_adam", "npu")
    assert ops.registry.chosen("fused_adam", "npu").name == "npu_torch_fused_adam"
    p, g, m, v = _state(*dtypes, seed=7)
    p64, g64, m64, v64 = _as64((p, g, m, v))
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, adam_w_mode=adam_w_mode,
              bias_correction=bias_correction)
    for step in (1, 2, torch.tensor(3)):
        fn(p, g, m, v, step=step, **kw)
        ref_optim.fused_adam(p64, g64, m64, v64, step=step, **kw)
    _check((p, m, v), (p64, m64, v64), "npu fused_adam")
    kernel = spies["_fused_adamw_" if adam_w_mode else "_fused_adam_"]
    uniform = dtypes[0] == dtypes[1]
    assert (kernel.calls > 0) == (uniform and bias_correction), (
        "torch's fused kernel serves same-dtype lists with bias correction; the rest take the foreach path")


def test_without_an_npu_fused_kernel_the_registry_falls_back_to_the_reference():
    with emulate("npu", no_fused_adam=True):
        text = ops.explain("fused_adam", "npu")
        assert "npu_torch_fused_adam" in text and "no fused Adam kernel for device type 'npu'" in text
        assert ops.registry.chosen("fused_adam", "npu").name == "reference"
        # the foreach ops still serve lion/lamb
        assert ops.registry.chosen("fused_lion", "npu").name == "npu_foreach_fused_lion"


def test_with_no_npu_runtime_every_npu_builder_is_incompatible():
    for op in ("fused_adam", "fused_lion", "fused_lamb", "quantize"):
        assert ops.registry.chosen(op, "npu").name == "reference"
        assert "needs the npu accelerator" in ops.explain(op, "npu")


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float16, torch.float32)])
def test_fused_lion_matches_reference(npu_runtime, dtypes):
    fn = ops.resolve("fused_lion", "npu")
    assert ops.registry.chosen("fused_lion", "npu").name == "npu_foreach_fused_lion"
    p, g, m, _ = _state(*dtypes, seed=11)
    p64, g64, m64 = _as64((p, g, m))
    for _ in range(3):
        fn(p, g, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
        ref_optim.fused_lion(p64, g64, m64, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    _check((p, m), (p64, m64), "npu fused_lion")


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_fused_lamb_matches_reference(npu_runtime, bias_correction, dtypes):
    fn = ops.resolve("fused_lamb", "npu")
    assert ops.registry.chosen("fused_lamb", "npu").name == "npu_foreach_fused_lamb"
    p, g, m, v = _state(*dtypes, seed=13)
    p64, g64, m64, v64 = _as64((p, g, m, v))
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction=bias_correction)
    for step in (1, 2):
        fn(p, g, m, v, step=step, **kw)
        ref_optim.fused_lamb(p64, g64, m64, v64, step=step, **kw)
    _check((p, m, v), (p64, m64, v64), "npu fused_lamb")


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_through_npu_quantize_equals_the_reference(npu_runtime, mode, symmetric, dtype):
    fn = ops.resolve("quantize", "npu")
    assert ops.registry.chosen("quantize", "npu").name == "npu_quantize"
    x = (torch.randn(6, 256) * 3 + 0.5).to(dtype)
    x[2] = 0.0  # an all-zero group
    got = fn(x, mode=mode, group_size=64, symmetric=symmetric)
    want = reference_quantize(x, mode=mode, group_size=64, symmetric=symmetric)
    assert got.data.dtype == want.data.dtype and torch.equal(got.data, want.data)
    assert torch.equal(got.scales, want.scales)
    assert (got.zero_points is None) == symmetric
    if not symmetric:
        assert torch.equal(got.zero_points, want.zero_points)
    assert (got.mode, got.group_size, got.shape, got.dtype) == (mode, 64, x.shape, dtype)
    call = npu_runtime.calls.last("npu_quantize")
    assert call.args[1] == (torch.qint8 if symmetric else torch.quint8) and call.args[2] == -1


def test_quantize_fp8_goes_to_the_reference_and_bad_input_is_named(npu_runtime):
    fn = ops.resolve("quantize", "npu")
    x = torch.randn(4, 128)
    got = fn(x, mode="fp8", group_size=128)
    want = reference_quantize(x, mode="fp8", group_size=128)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert npu_runtime.calls.count_of("npu_quantize") == 0
    with pytest.raises(ValueError, match="group_size 100 does not divide"):
        fn(x, mode="int8", group_size=100)


@pytest.mark.parametrize("mode,symmetric", [("int8", True), ("int8", False), ("int4", True), ("int4", False)])
def test_quantize_gives_a_group_holding_nan_or_inf_a_nan_scale(npu_runtime, mode, symmetric):
    x = torch.randn(4, 64)
    x[1, 5], x[3, 63] = float("nan"), float("inf")
    got = ops.resolve("quantize", "npu")(x, mode=mode, group_size=64, symmetric=symmetric)
    want = reference_quantize(x, mode, 64, symmetric)
    assert got.scales.isnan().tolist() == [False, True, False, True]
    assert torch.equal(got.scales.nan_to_num(), want.scales.nan_to_num()) and torch.equal(got.data, want.data)
    assert bool(ops.dequantize(got)[[1, 3]].isnan().all())
