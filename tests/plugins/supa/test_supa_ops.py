"""supa op builders: torch_supa_ext kernels where their math is polyaccel's, the reference otherwise."""

from __future__ import annotations

import pytest
import torch
from polyaccel import ops
from polyaccel.ops.reference import optimizers as ref_optim
from polyaccel.testing.emulation import emulate
from polyaccel.testing.numerics import assert_close_to_reference

SHAPES = [(40,), (6, 7), (0,), (97,)]


def _state(param_dtype, state_dtype, seed, n=4):
    gen = torch.Generator().manual_seed(seed)
    lists = []
    for k in range(n):
        dtype = param_dtype if k < 2 else state_dtype
        scale = (1.0, 0.1, 0.05, 0.01)[k]
        lists.append([(torch.randn(s, generator=gen) * scale).abs().to(dtype) if k == 3
                      else (torch.randn(s, generator=gen) * scale).to(dtype) for s in SHAPES])
    return lists


def _ref_copies(lists):
    return [[t.double() if t.dtype == torch.float32 else t.clone() for t in lst] for lst in lists]


def _check(got, want, what):
    for j, (gl, wl) in enumerate(zip(got, want, strict=True)):
        for i, (g, w) in enumerate(zip(gl, wl, strict=True)):
            assert_close_to_reference(g, w, g.dtype, f"{what}: list {j} tensor {i}")


@pytest.fixture
def supa_runtime():
    with emulate("supa") as rt:
        yield rt


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_fused_adam_runs_the_extension_kernel_and_matches_reference(supa_runtime, adam_w_mode, bias_correction):
    fn = ops.resolve("fused_adam", "supa")
    assert ops.registry.chosen("fused_adam", "supa").name == "supa_ext_fused_adam"
    p, g, m, v = _state(torch.float32, torch.float32, seed=3)
    ref = _ref_copies((p, g, m, v))
    kw = dict(lr=5e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.02, adam_w_mode=adam_w_mode,
              bias_correction=bias_correction)
    for step in (1, torch.tensor(2)):
        fn(p, g, m, v, step=step, **kw)
        ref_optim.fused_adam(*ref, step=step, **kw)
    _check((p, m, v), (ref[0], ref[2], ref[3]), "supa fused_adam")
    call = supa_runtime.calls.last("deepspeed.multi_tensor_adam")
    assert call.kwargs == {"step": 2, "mode": 1 if adam_w_mode else 0, "bias_correction": bias_correction}
    assert call.args == (3,), "the empty tensor is not handed to the kernel"


def test_mixed_dtypes_go_to_the_reference_for_those_tensors(supa_runtime):
    fn = ops.resolve("fused_adam", "supa")
    p, g, m, v = _state(torch.bfloat16, torch.float32, seed=5)
    ref = _ref_copies((p, g, m, v))
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    fn(p, g, m, v, **kw)
    ref_optim.fused_adam(*ref, **kw)
    _check((p, m, v), (ref[0], ref[2], ref[3]), "supa fused_adam mixed")
    assert supa_runtime.calls.count_of("deepspeed.multi_tensor_adam") == 0


def test_fused_lion_runs_the_extension_kernel(supa_runtime):
    fn = ops.resolve("fused_lion", "supa")
    assert ops.registry.chosen("fused_lion", "supa").name == "supa_ext_fused_lion"
    p, g, m = _state(torch.float32, torch.float32, seed=9, n=3)
    ref = _ref_copies((p, g, m))
    for _ in range(3):
        fn(p, g, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
        ref_optim.fused_lion(*ref, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    _check((p, m), (ref[0], ref[2]), "supa fused_lion")
    assert supa_runtime.calls.count_of("deepspeed.multi_tensor_lion") == 3


@pytest.mark.parametrize("bias_correction", [True, False])
def test_fused_lamb_uses_the_kernel_only_where_its_math_is_ours(supa_runtime, bias_correction):
    fn = ops.resolve("fused_lamb", "supa")
    assert ops.registry.chosen("fused_lamb", "supa").name == "supa_ext_fused_lamb"
    p, g, m, v = _state(torch.float32, torch.float32, seed=21)
    ref = _ref_copies((p, g, m, v))
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction=bias_correction)
    for step in (1, 2):
        fn(p, g, m, v, step=step, **kw)
        ref_optim.fused_lamb(*ref, step=step, **kw)
    _check((p, m, v), (ref[0], ref[2], ref[3]), "supa fused_lamb")
    kernel_calls = supa_runtime.calls.count_of("deepspeed.lamb")
    assert kernel_calls == (0 if bias_correction else 2 * 3)


def test_the_extension_lamb_differs_from_polyaccels_with_bias_correction(supa_runtime):
    """Why the builder avoids the kernel there: the same inputs give another result."""
    import torch_supa_ext.deepspeed  # noqa: F401 - registers torch.ops.deepspeed.*

    p, g, m, v = (t[0] for t in _state(torch.float32, torch.float32, seed=4))
    p2, m2, v2 = p.clone().double(), m.clone().double(), v.clone().double()
    torch.ops.deepspeed.lamb(p, torch.empty(0), m, v, g, 1e-2, 0.9, 0.999, 10.0, 0.01, 1e-3, 1.0, 1, 1, True, 0.01)
    ref_optim.fused_lamb([p2], [g.double()], [m2], [v2], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-3,
                         weight_decay=0.01, step=1, bias_correction=True)
    assert not torch.allclose(p.double(), p2, rtol=1e-6, atol=1e-7)


def test_without_the_extension_the_reference_serves_every_optimizer():
    with emulate("supa", ext_missing=True):
        for op in ("fused_adam", "fused_lion", "fused_lamb"):
            assert ops.registry.chosen(op, "supa").name == "reference"
            assert "torch_supa_ext is not installed" in ops.explain(op, "supa")


def test_quantize_on_supa_is_the_reference():
    with emulate("supa"):
        assert ops.registry.chosen("quantize", "supa").name == "reference"


def test_kernels_appear_when_the_plugin_imports_the_extension():
    with emulate("supa") as rt:
        assert not hasattr(torch.ops.deepspeed, "multi_tensor_adam"), "nothing is registered before the import"
        ops.resolve("fused_adam", "supa")
        assert "import torch_supa_ext.deepspeed" in rt.calls.names()
        assert hasattr(torch.ops.deepspeed, "multi_tensor_adam")
