"""The fused expert ops' conformance checks pass the reference and fail plausible wrong builders."""

from __future__ import annotations

import pytest
import torch
from polyaccel.ops import reference as ref
from polyaccel.ops.reference.gather_sum import gather_sum
from polyaccel.ops.reference.grouped_mm import grouped_mm
from polyaccel.ops.reference.moe_experts import routed_tokens
from polyaccel.ops.reference.swiglu import swiglu
from polyaccel.testing.conformance import opcases, opcases_moe

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_passes(dtype):
    opcases_moe.check_moe_gate_up(ref.moe_gate_up, CPU, dtype)
    opcases_moe.check_moe_down_combine(ref.moe_down_combine, CPU, dtype)


def _gate_up(epilogue):
    def fn(x, index, weight, offsets):
        gate, up = grouped_mm(x.index_select(0, routed_tokens(index)), weight, offsets).chunk(2, dim=-1)
        return epilogue(gate, up)
    return fn


@pytest.mark.parametrize("name,epilogue", [
    ("silu on the up half", lambda gate, up: swiglu(up, gate)),
    ("no silu", lambda gate, up: gate * up),
    ("gate alone", lambda gate, up: torch.nn.functional.silu(gate)),
])
def test_gate_up_check_rejects_a_wrong_epilogue(name, epilogue):
    with pytest.raises(AssertionError, match="moe_gate_up"):
        opcases_moe.check_moe_gate_up(_gate_up(epilogue), CPU, torch.float32)


def test_gate_up_check_rejects_a_dispatch_without_the_slot_order():
    def token_order(x, index, weight, offsets):  # routed row r read as token r // k, not the token index names
        k = index.shape[1]
        tok = torch.arange(index.numel()) // k
        gate, up = grouped_mm(x.index_select(0, tok), weight, offsets).chunk(2, dim=-1)
        return swiglu(gate, up)

    with pytest.raises(AssertionError, match="moe_gate_up"):
        opcases_moe.check_moe_gate_up(token_order, CPU, torch.float32)


def test_gate_up_check_rejects_a_dx_that_keeps_one_slot():
    class FirstSlotDx(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, index):
            ctx.save_for_backward(index)
            ctx.rows = x.shape[0]
            return x.index_select(0, routed_tokens(index))

        @staticmethod
        def backward(ctx, grad):
            (index,) = ctx.saved_tensors
            return grad.index_select(0, index[:, 0].long()), None

    def fn(x, index, weight, offsets):
        gate, up = grouped_mm(FirstSlotDx.apply(x, index), weight, offsets).chunk(2, dim=-1)
        return swiglu(gate, up)

    with pytest.raises(AssertionError, match="d x"):
        opcases_moe.check_moe_gate_up(fn, CPU, torch.float32)


@pytest.mark.parametrize("name,fn", [
    ("router weight not applied", lambda h, w, off, index, weights=None: gather_sum(grouped_mm(h, w, off), index)),
    ("a slot dropped", lambda h, w, off, index, weights=None: gather_sum(
        grouped_mm(h, w, off)[index[:, 0].long()], torch.arange(index.shape[0]).view(-1, 1),
        None if weights is None else weights[:, :1])),
    ("weight applied twice", lambda h, w, off, index, weights=None: gather_sum(
        grouped_mm(h, w, off), index, None if weights is None else weights * weights)),
])
def test_down_combine_check_rejects_a_wrong_combine(name, fn):
    with pytest.raises(AssertionError, match="moe_down_combine"):
        opcases_moe.check_moe_down_combine(fn, CPU, torch.float32)


def test_down_combine_check_rejects_a_router_weight_without_gradient():
    def fn(h, w, off, index, weights=None):
        return gather_sum(grouped_mm(h, w, off), index, None if weights is None else weights.detach())

    with pytest.raises(AssertionError, match="d weights"):
        opcases_moe.check_moe_down_combine(fn, CPU, torch.float32)


# ------------------------------------------------------------------ weighted_swiglu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_weighted_swiglu_reference_passes(dtype):
    opcases.check_weighted_swiglu(ref.weighted_swiglu, CPU, dtype)


def _weighted(forward):
    return ref.make_weighted_swiglu(forward, ref.weighted_swiglu_backward)


@pytest.mark.parametrize("name,fn,match", [
    ("weights ignored", _weighted(lambda g, u, w: ref.swiglu_forward(g, u)), "forward"),
    ("weights applied twice", _weighted(lambda g, u, w: ref.weighted_swiglu_forward(g, u, w * w)), "forward"),
    ("weights on the wrong rows", _weighted(lambda g, u, w: ref.weighted_swiglu_forward(g, u, w.flip(0))), "forward"),
    ("no weights' gradient", ref.make_weighted_swiglu(
        ref.weighted_swiglu_forward, lambda go, g, u, w, need: (*ref.weighted_swiglu_backward(go, g, u, w, False)[:2],
                                                                 torch.zeros_like(w) if need else None)), "d weights"),
    ("input gradients unweighted", ref.make_weighted_swiglu(
        ref.weighted_swiglu_forward, lambda go, g, u, w, need: (*ref.swiglu_backward(go, g, u),
                                                                 ref.weighted_swiglu_backward(go, g, u, w, need)[2])),
     "d gate"),
])
def test_weighted_swiglu_check_rejects_a_wrong_builder(name, fn, match):
    with pytest.raises(AssertionError, match=match):
        opcases.check_weighted_swiglu(fn, CPU, torch.float32)
