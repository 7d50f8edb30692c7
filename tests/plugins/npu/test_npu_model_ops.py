"""rms_norm and rope on npu: torch_npu's fused npu_rms_norm / npu_rotary_mul (emulated, on CPU tensors),
forward and backward against float64, the vendor op really called, and the fallbacks to the reference."""

from __future__ import annotations

import pytest
import torch
from polyaccel import ops
from polyaccel.errors import OpArgumentError
from polyaccel.ops import reference as ref
from polyaccel.testing.conformance import opcases_model
from polyaccel.testing.emulation import emulate

CPU = torch.device("cpu")


@pytest.fixture
def npu_runtime():
    with emulate("npu") as rt:
        yield rt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_builders_run_the_vendor_ops_and_match_float64(npu_runtime, dtype):
    assert ops.registry.chosen("rms_norm", "npu").name == "npu_rms_norm"
    assert ops.registry.chosen("rope", "npu").name == "npu_rotary_mul"
    rms, rope = ops.resolve("rms_norm", "npu"), ops.resolve("rope", "npu")
    opcases_model.check_rms_norm(rms, CPU, dtype)
    opcases_model.check_rope(rope, CPU, dtype)
    assert npu_runtime.calls.count_of("npu_rms_norm") > 0
    modes = {c.args[3] for c in npu_runtime.calls if c.name == "npu_rotary_mul"}
    assert modes == {"half", "interleave"}


def test_npu_gemma_offset_runs_the_vendor_op_in_fp32_and_fp64_goes_to_the_reference(npu_runtime):
    rms = ops.resolve("rms_norm", "npu")
    x = torch.randn(4, 16).bfloat16()
    w = (torch.randn(16) * 0.01).bfloat16()  # Gemma's small weights: a bf16 (1 + w) would round them away
    y = rms(x, w, 1e-6, offset=1.0)
    call = npu_runtime.calls.last("npu_rms_norm")
    assert call.args[1] == torch.float32 and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref.rms_norm(x, w, 1e-6, offset=1.0), rtol=0, atol=0)
    n = npu_runtime.calls.count_of("npu_rms_norm")
    x64 = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(rms(x64, None, 1e-6), ref.rms_norm(x64, None, 1e-6))
    assert npu_runtime.calls.count_of("npu_rms_norm") == n
    rope = ops.resolve("rope", "npu")
    q, k, c = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(3, 4)
    m = npu_runtime.calls.count_of("npu_rotary_mul")
    got = rope(q.bfloat16(), k.bfloat16(), c, c)  # cos/sin fp32 for bf16 q: not one dtype, the reference serves it
    want = ref.rope(q.bfloat16(), k.bfloat16(), c, c)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert npu_runtime.calls.count_of("npu_rotary_mul") == m


def test_emulated_vendor_ops_follow_their_documented_semantics(npu_runtime):
    import torch_npu

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 4, 8, generator=gen, dtype=torch.float32, requires_grad=True)
    r1 = torch.randn(1, 1, 4, 8, generator=gen, requires_grad=True)
    r2 = torch.randn(1, 1, 4, 8, generator=gen, requires_grad=True)
    x1, x2 = x.detach().chunk(2, -1)
    torch.testing.assert_close(torch_npu.npu_rotary_mul(x, r1, r2),
                               r1.detach() * x.detach() + r2.detach() * torch.cat((-x2, x1), -1))
    # differentiable in all three (RotaryMulGrad), r1/r2 gradients reduced to their broadcast shape
    dy = torch.randn(x.shape, generator=gen)
    got = torch.autograd.grad(torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode="interleave"), (x, r1, r2), dy)
    pairs = x.unflatten(-1, (-1, 2))
    partner = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    want = torch.autograd.grad(r1 * x + r2 * partner, (x, r1, r2), dy)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    with pytest.raises(RuntimeError, match="even and < 896"):
        torch_npu.npu_rotary_mul(torch.randn(1, 1, 2, 7), torch.randn(1, 1, 2, 7), torch.randn(1, 1, 2, 7))
    with pytest.raises(RuntimeError, match="one dtype"):
        torch_npu.npu_rotary_mul(x.detach().bfloat16(), r1.detach(), r2.detach())
    y, rstd = torch_npu.npu_rms_norm(x.detach(), torch.ones(8), epsilon=1e-5)
    assert rstd.shape == (2, 3, 4, 1) and rstd.dtype == torch.float32
    torch.testing.assert_close(y, ref.rms_norm(x.detach(), None, 1e-5))
    g64 = [torch.randn(3, 8, dtype=torch.float64).requires_grad_(), torch.randn(8, dtype=torch.float64)]
    with pytest.raises(RuntimeError, match="one dtype"):
        torch_npu.npu_rms_norm(*g64)  # the vendor op has no fp64
    with pytest.raises(RuntimeError, match="2-8 dimensions"):
        torch_npu.npu_rms_norm(torch.randn(8), torch.ones(8))


def test_without_the_vendor_ops_the_reference_serves(monkeypatch):
    with emulate("npu", no_model_ops=True):
        for op in ("rms_norm", "rope"):
            assert ops.registry.chosen(op, "npu").name == "reference"
            assert "this torch_npu has no npu_" in ops.explain(op, "npu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_swiglu_runs_the_vendor_op_and_matches_float64(npu_runtime, dtype):
    from polyaccel.testing.conformance import opcases

    assert ops.registry.chosen("swiglu", "npu").name == "npu_swiglu"
    fn = ops.resolve("swiglu", "npu")
    opcases.check_swiglu(fn, CPU, dtype)
    assert npu_runtime.calls.count_of("npu_swiglu") > 0
    gen = torch.Generator().manual_seed(7)
    gate = torch.randn(3, 5, 16, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    up = torch.randn(3, 5, 16, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    out = fn(gate, up)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(g.to(dtype))
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    want = torch.nn.functional.silu(g64) * u64
    want.backward(g)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.double(), want, **tol)
    torch.testing.assert_close(gate.grad.double(), g64.grad, **tol)
    torch.testing.assert_close(up.grad.double(), u64.grad, **tol)


def test_npu_swiglu_refusals_and_fallbacks(npu_runtime):
    import torch_npu

    with pytest.raises(RuntimeError, match="even"):
        torch_npu.npu_swiglu(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch_npu.npu_swiglu(torch.randn(4, 6).t())
    with pytest.raises(RuntimeError, match="float16, bfloat16 or float32"):
        torch_npu.npu_swiglu(torch.randn(2, 4, dtype=torch.float64))
    fn = ops.resolve("swiglu", "npu")
    n = npu_runtime.calls.count_of("npu_swiglu")
    g, u = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(fn(g, u), ref.swiglu(g, u), rtol=0, atol=0)  # fp64: the reference serves it
    assert npu_runtime.calls.count_of("npu_swiglu") == n
    with pytest.raises(OpArgumentError, match="differ in shape"):
        fn(torch.randn(2, 4), torch.randn(2, 3))


def test_npu_without_swiglu_falls_back_to_the_reference():
    with emulate("npu", no_model_ops=True):
        assert ops.registry.chosen("swiglu", "npu").name != "npu_swiglu"
