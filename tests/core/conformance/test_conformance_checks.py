"""The suite's checks can fail: each one rejects a plausible wrong implementation."""

from __future__ import annotations

import pytest
import torch
from polyaccel.accelerator import KNOWN_CAPABILITIES
from polyaccel.errors import Unsupported
from polyaccel.ops import builtin, torch_optim
from polyaccel.ops import reference as ref
from polyaccel.ops.reference.swiglu import make_swiglu, swiglu_forward
from polyaccel.plugins.cpu.accelerator import CpuAccelerator
from polyaccel.testing.conformance import opcases
from polyaccel.testing.conformance.checks import CHECKED_CAPABILITIES, expect_unsupported

CPU = torch.device("cpu")


def test_every_known_capability_and_op_has_a_check():
    assert set(KNOWN_CAPABILITIES) <= CHECKED_CAPABILITIES
    assert set(builtin.REFERENCE_OPS) <= set(opcases.OP_DTYPES)


def test_expect_unsupported():
    acc = CpuAccelerator()
    assert "does not support graphs" in expect_unsupported(acc, acc.create_graph, "create_graph()", "graphs")
    with pytest.raises(pytest.fail.Exception, match="silent no-op"):
        expect_unsupported(acc, lambda: None, "register_host_memory(t)", "host_register")
    with pytest.raises(pytest.fail.Exception, match="naming plugin 'other'"):
        expect_unsupported(acc, lambda: (_ for _ in ()).throw(Unsupported("other", "x")), "f()", "x")
    with pytest.raises(pytest.fail.Exception, match="raised ValueError"):
        expect_unsupported(acc, lambda: int("x"), "f()", "x")


@pytest.mark.parametrize("op", ["fused_adam", "fused_lion", "fused_lamb"])
def test_optimizer_check_accepts_cpu_builder_and_rejects_a_wrong_lr(op):
    cpu_builder = {"fused_adam": torch_optim.fused_adam, "fused_lion": torch_optim.foreach_lion,
                   "fused_lamb": torch_optim.foreach_lamb}[op]
    opcases.check_optimizer(op, cpu_builder, CPU, torch.bfloat16)
    real = getattr(ref, op)

    def off_by_a_bit(*args, lr, **kw):
        real(*args, lr=lr * 1.05, **kw)

    with pytest.raises(AssertionError, match="param"):
        opcases.check_optimizer(op, off_by_a_bit, CPU, torch.float32)


def test_optimizer_check_rejects_a_builder_that_skips_small_tensors():
    def skips_tiny(params, grads, m, v, **kw):
        keep = [i for i, p in enumerate(params) if p.numel() > 8]
        ref.fused_adam(*([lst[i] for i in keep] for lst in (params, grads, m, v)), **kw)

    with pytest.raises(AssertionError, match="shape"):
        opcases.check_optimizer("fused_adam", skips_tiny, CPU, torch.float32)


def test_quantize_check_rejects_wrong_codes_and_scales():
    opcases.check_quantize(ref.quantize, CPU, torch.float32, fp8=True)

    def codes_off_by_two(x, **kw):
        qt = ref.quantize(x, **kw)
        if qt.mode == "int8" and qt.symmetric:
            qt.data = (qt.data.to(torch.int16) + 2).clamp(-127, 127).to(torch.int8)
        return qt

    with pytest.raises(AssertionError, match="codes differ"):
        opcases.check_quantize(codes_off_by_two, CPU, torch.float32, fp8=False)

    def scales_too_big(x, **kw):
        qt = ref.quantize(x, **kw)
        qt.scales = qt.scales * 1.01
        return qt

    with pytest.raises(AssertionError, match="scales"):
        opcases.check_quantize(scales_too_big, CPU, torch.bfloat16, fp8=False)


def test_dequantize_check_rejects_ignored_zero_points():
    opcases.check_dequantize(ref.dequantize, CPU, torch.float16, fp8=False)

    def ignores_zero_points(qt, dtype=None):
        return ref.dequantize(ref.QuantizedTensor(qt.data, qt.scales, None if qt.zero_points is None else
                                                  torch.zeros_like(qt.zero_points), qt.mode, qt.group_size,
                                                  qt.shape, qt.dtype), dtype=dtype)

    with pytest.raises(AssertionError, match="asym"):
        opcases.check_dequantize(ignores_zero_points, CPU, torch.float32, fp8=False)


def test_swiglu_check_rejects_a_wrong_backward():
    opcases.check_swiglu(ref.swiglu, CPU, torch.float64)

    def wrong_backward(grad_out, gate, up):
        sig = torch.sigmoid(gate.float())
        return (grad_out * up * sig).to(gate.dtype), (grad_out * gate * sig).to(up.dtype)  # misses a term

    with pytest.raises(AssertionError, match="d gate"):
        opcases.check_swiglu(make_swiglu(swiglu_forward, wrong_backward), CPU, torch.float32)


def test_grouped_mm_check_rejects_ignored_offsets_and_dirty_tail():
    opcases.check_grouped_mm(ref.grouped_mm, CPU, torch.bfloat16)

    def first_expert_only(x, w, offsets):
        return x @ w[0]

    with pytest.raises(AssertionError, match="grouped_mm"):
        opcases.check_grouped_mm(first_expert_only, CPU, torch.float32)

    def dirty_tail(x, w, offsets):
        out = ref.grouped_mm(x, w, offsets)
        end = int(offsets[-1]) if offsets.numel() else 0
        out[end:] = 1.0
        return out

    with pytest.raises(AssertionError, match="grouped_mm"):
        opcases.check_grouped_mm(dirty_tail, CPU, torch.float32)


def test_gather_sum_check_rejects_a_wrong_weight_gradient_and_a_dropped_slot():
    from polyaccel.ops.reference import gather_sum_backward, gather_sum_forward, make_gather_sum

    opcases.check_gather_sum(ref.gather_sum, CPU, torch.bfloat16)

    def unweighted_d_rows(grad_out, rows, index, weights, need_d_weights):
        return gather_sum_backward(grad_out, rows, index, None, False)[0], (
            gather_sum_backward(grad_out, rows, index, weights, need_d_weights)[1])

    with pytest.raises(AssertionError, match="d rows"):
        opcases.check_gather_sum(make_gather_sum(gather_sum_forward, unweighted_d_rows), CPU, torch.float32)

    def first_slot_only(rows, index, weights):
        return gather_sum_forward(rows, index[:, :1].contiguous(), None if weights is None else weights[:, :1])

    with pytest.raises(AssertionError, match="forward"):
        opcases.check_gather_sum(make_gather_sum(first_slot_only, gather_sum_backward), CPU, torch.float32)
