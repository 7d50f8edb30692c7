"""The fused expert kernels (moe_gate_up, moe_down_combine) under the Triton interpreter, against float64."""

from __future__ import annotations

import pytest
import torch
from polyaccel.ops import reference as ref
from polyaccel.ops.reference.moe_experts import routed_tokens
from polyaccel.plugins.cuda.kernels import moe_experts as km
from polyaccel.testing.conformance import opcases_moe

CPU = torch.device("cpu")


@pytest.fixture
def fused_fp32(monkeypatch):
    """The kernels take fp32 too (the GPU builder leaves it to the unfused path); checked here at fp32 bounds."""
    monkeypatch.setattr(km, "FUSED_DTYPES", (torch.bfloat16, torch.float16, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_pass_the_conformance_checks(fused_fp32, dtype):
    torch.manual_seed(7)
    opcases_moe.check_moe_gate_up(km.moe_gate_up, CPU, dtype)
    opcases_moe.check_moe_down_combine(km.moe_down_combine, CPU, dtype)


def test_kernels_run_for_bf16_and_take_the_unfused_path_for_float64(monkeypatch):
    calls = []
    real = km._GateUp.apply
    monkeypatch.setattr(km._GateUp, "apply", lambda *a: calls.append(a[0].dtype) or real(*a))
    x = torch.randn(6, 16)
    index = torch.randperm(12).view(6, 2)
    offsets = torch.tensor([5, 12])
    w = torch.randn(2, 16, 8)
    for dtype in (torch.bfloat16, torch.float64):
        out = km.moe_gate_up(x.to(dtype), index, w.to(dtype), offsets)
        want = ref.moe_gate_up(x.double(), index, w.double(), offsets)
        assert out.dtype == dtype
        tol = 0 if dtype == torch.float64 else 0.05
        assert float((out.double() - want).abs().max()) <= tol * float(want.abs().max())
    assert calls == [torch.bfloat16], "bf16 runs the fused kernel, float64 the unfused ops"


def test_rows_past_the_last_offset_and_an_empty_expert(fused_fp32):
    T, k, H, F = 7, 2, 20, 12
    x = torch.randn(T, H)
    index = torch.randperm(T * k).view(T, k)
    offsets = torch.tensor([0, 6, 6, 10])  # experts 0 and 2 get nothing, rows 10..13 are past the end
    w1 = torch.randn(4, H, 2 * F, requires_grad=True)
    h = km.moe_gate_up(x, index, w1, offsets)
    assert bool((h[10:] == 0).all()), "rows past the last offset are zero"
    h.sum().backward()
    assert bool((w1.grad[0] == 0).all()) and bool((w1.grad[2] == 0).all()), "experts without rows: zero gradient"
    assert bool((w1.grad[1] != 0).any())


def test_weight_gradient_is_written_in_the_parameter_layout():
    """A transposed view of an [E, N, K] parameter gets its gradient in the parameter's strides (no copy)."""
    param = torch.randn(3, 10, 16)
    w = param.transpose(1, 2)  # [E, K=16, N=10]
    a, b = torch.randn(9, 16), torch.randn(9, 10)
    off = torch.tensor([4, 4, 9])
    dw = km.gathered_wgrad(a, b, off, 3, like=w)
    assert dw.stride() == w.stride()
    want = torch.stack([a[0:4].T @ b[0:4], torch.zeros(16, 10), a[4:9].T @ b[4:9]])
    torch.testing.assert_close(dw, want, rtol=1e-5, atol=1e-5)


def test_down_kernel_scatters_a_permutation_to_the_token_rows(fused_fp32):
    """k = 1: each routed row goes straight to its token, weighted in the epilogue (no gather_sum)."""
    T, H, F = 11, 9, 7
    h = torch.randn(T, F, dtype=torch.float32)
    w2 = torch.randn(2, F, H)
    index = torch.randperm(T).view(T, 1)
    weights = torch.rand(T, 1)
    offsets = torch.tensor([4, 11], dtype=torch.int32)
    out = km.down_forward(h, w2, offsets.long(), dst=km.slot_positions(index), scale=km.row_weights(index, weights),
                          out_rows=T)
    want = ref.moe_down_combine(h.double(), w2.double(), offsets, index, weights.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(routed_tokens(index), km.slot_positions(index)), "k = 1: slot t is token t"
