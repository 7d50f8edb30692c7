"""The cuda plugin's kernel builders (quantize, swiglu, grouped_mm, the expert ops ...): registration and honest
reasons."""

from __future__ import annotations

import importlib

import pytest
import torch
from polyaccel.accelerator import ProbeResult
from polyaccel.ops import OpRegistry
from polyaccel.plugins.cuda import ops as kb

#: the ops of the plugin's builders besides the multi-tensor optimizers
_KERNEL_OPS = ("quantize", "dequantize", "swiglu", "weighted_swiglu", "grouped_mm", "gather_sum", "moe_gate_up",
               "moe_down_combine")


class _FakeGpu:
    """Just enough of an accelerator for the compatibility checks."""

    name = "cuda"
    device_type = "cuda"

    def __init__(self, available=True, emulated=False):
        self._available = available
        self._emulated = emulated

    def probe(self):
        return ProbeResult(self._available, "" if self._available else "no driver", int(self._available))

    def is_emulated(self):
        return self._emulated

    def current_device(self):
        return 0


def _registry():
    reg = OpRegistry(lambda device_type: None)
    for builder in kb.builders(_KERNEL_OPS):
        reg.add(builder)
    return reg


def test_register_adds_one_builder_per_op_and_torch_grouped_mm():
    reg = _registry()
    names = {op: [b.name for b in reg.builders(op)] for op in reg.ops()}
    assert names == {
        "quantize": ["triton_quantize"], "dequantize": ["triton_dequantize"], "swiglu": ["triton_swiglu"],
        "weighted_swiglu": ["triton_weighted_swiglu"],
        "grouped_mm": ["triton_grouped_mm", "torch_grouped_mm"], "gather_sum": ["triton_gather_sum"],
        "moe_gate_up": ["torch_moe_gate_up"], "moe_down_combine": ["torch_moe_down_combine"],
    }
    for op in names:
        for b in reg.builders(op):
            assert b.device_types == ("cuda",) and b.description
            assert b.kind == ("torch" if b.name.startswith("torch_") else "triton")


@pytest.mark.parametrize("op,name,module,attr", [
    ("quantize", "triton_quantize", "quantize", "quantize"),
    ("dequantize", "triton_dequantize", "quantize", "dequantize"),
    ("swiglu", "triton_swiglu", "swiglu", "swiglu"),
    ("weighted_swiglu", "triton_weighted_swiglu", "swiglu", "weighted_swiglu"),
    ("grouped_mm", "triton_grouped_mm", "grouped_mm", "grouped_mm"),
    ("grouped_mm", "torch_grouped_mm", "grouped_mm", "torch_grouped_mm"),
    ("gather_sum", "triton_gather_sum", "gather_sum", "gather_sum"),
    ("moe_gate_up", "torch_moe_gate_up", "moe_grouped", "moe_gate_up"),
    ("moe_down_combine", "torch_moe_down_combine", "moe_grouped", "moe_down_combine"),
])
def test_loaders_return_the_kernel_functions(op, name, module, attr):
    builder = next(b for b in _registry().builders(op) if b.name == name)
    mod = importlib.import_module(f"polyaccel.plugins.cuda.kernels.{module}")
    assert builder.load() is getattr(mod, attr)


def test_without_a_gpu_every_builder_says_why():
    reg = _registry()
    for op in reg.ops():
        for cand in reg.candidates(op, "cuda"):
            assert not cand.chosen and cand.reason.startswith("incompatible: ") and len(cand.reason) > 20
    quant = reg.candidates("quantize", "cuda")[0]
    assert "no usable accelerator" in quant.reason


def test_triton_builders_name_the_interpreter_on_a_fake_gpu():
    ok, why = kb.builders(_KERNEL_OPS)[0].is_compatible(_FakeGpu())
    assert not ok and "TRITON_INTERPRET" in why


@pytest.mark.parametrize("cap,ok", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)])
def test_fp8_compatibility_follows_compute_capability(monkeypatch, cap, ok):
    monkeypatch.setattr(kb, "triton_compatible", lambda acc: (True, ""))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.version, "hip", None)
    got, why = kb.fp8_compatible(_FakeGpu())
    assert got is ok
    if not ok:
        assert f"{cap[0]}.{cap[1]}" in why and "8.9" in why and "int8" in why


@pytest.mark.parametrize("cap,ok", [((8, 0), False), ((9, 0), True), ((10, 0), True)])
def test_torch_grouped_mm_compatibility(monkeypatch, cap, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    got, why = kb.torch_grouped_mm_compatible(_FakeGpu())
    assert got is ok
    if not ok:
        assert "9.0" in why


def test_torch_moe_builders_need_torch_grouped_mm_and_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    ok, why = kb.torch_moe_compatible(_FakeGpu())
    assert not ok and "TRITON_INTERPRET" in why, "the Triton passes need a Triton GPU"
    monkeypatch.setattr(kb, "triton_compatible", lambda acc: (True, ""))
    assert kb.torch_moe_compatible(_FakeGpu()) == (True, "")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    ok, why = kb.torch_moe_compatible(_FakeGpu())
    assert not ok and "9.0" in why, "and torch._grouped_mm's compute capability"


def test_the_all_triton_fused_expert_builders_are_gone(monkeypatch):
    """They ran at 0.57-0.85x of the default path and were never chosen (docs/autoep.md): taken out, so
    neither the plugin's table, nor the process's registry, nor ``explain`` lists them; the module is gone."""
    from polyaccel import ops

    monkeypatch.setenv("POLYACCEL_PLUGINS", "cpu,cuda")
    for op in ("moe_gate_up", "moe_down_combine"):
        assert [b.name for b in _registry().builders(op)] == [f"torch_{op}"]
        names = {b.name for b in ops.registry.builders(op)}
        assert f"torch_{op}" in names and f"triton_{op}" not in names
        text = ops.explain(op, "cuda")
        assert f"torch_{op}" in text and "triton_" not in text
    assert importlib.util.find_spec("polyaccel.plugins.cuda.kernels.moe_experts") is None


def test_torch_grouped_mm_reasons_for_missing_pieces(monkeypatch):
    assert kb.torch_grouped_mm_compatible(None) == (False, "no usable accelerator serves this device type "
                                                           "(no CUDA GPU here)")
    ok, why = kb.torch_grouped_mm_compatible(_FakeGpu(available=False))
    assert not ok and "no driver" in why
    ok, why = kb.torch_grouped_mm_compatible(_FakeGpu(emulated=True))
    assert not ok and "emulated" in why
    monkeypatch.delattr(torch, "_grouped_mm")
    ok, why = kb.torch_grouped_mm_compatible(_FakeGpu())
    assert not ok and "_grouped_mm" in why


@pytest.mark.parametrize("formats,ok", [(("float8_e4m3fnuz", "float8_e5m2fnuz"), False),
                                        (("float8_e4m3fn", "float8_e5m2"), True), ((), False)])
def test_fp8_on_rocm_follows_the_accelerators_fp8_formats(monkeypatch, formats, ok):
    monkeypatch.setattr(kb, "triton_compatible", lambda acc: (True, ""))
    monkeypatch.setattr(torch.version, "hip", "6.4")
    gpu = _FakeGpu()
    gpu.name = "rocm"
    gpu.fp8_dtypes = lambda: tuple(getattr(torch, n) for n in formats)
    got, why = kb.fp8_compatible(gpu)
    assert got is ok
    if not ok:
        assert "float8_e4m3fn" in why
