"""Op registry: best builder per (op, device type), explain, overrides, isolation."""

import polyaccel
import pytest
import torch
from polyaccel import selection
from polyaccel.errors import OpError
from polyaccel.hookspecs import hookimpl
from polyaccel.ops import OpBuilder, OpRegistry


def _scale_by(k):
    def fn(x, weight, offsets):
        return torch.full((x.shape[0], weight.shape[2]), float(k))
    return fn


def test_priority_compatibility_and_explain():
    reg = OpRegistry()
    loads = []
    reg.add(OpBuilder("grouped_mm", "slow", ("cpu",), lambda: _scale_by(1), priority=1))
    reg.add(OpBuilder("grouped_mm", "fast", ("cpu",), lambda: loads.append(1) or _scale_by(2), priority=5))
    reg.add(OpBuilder("grouped_mm", "gpu_only", ("cuda",), lambda: _scale_by(3), priority=9))
    reg.add(OpBuilder("grouped_mm", "broken_check", ("cpu",), lambda: _scale_by(4), priority=8,
                      compatible=lambda acc: (False, "needs the vendor library libfoo")))
    fn = reg.resolve("grouped_mm", "cpu")
    assert fn(torch.zeros(2, 1), torch.zeros(1, 1, 3), None)[0, 0] == 2
    reg.resolve("grouped_mm", "cpu")
    assert loads == [1]  # lazy and cached
    text = reg.explain("grouped_mm", "cpu")
    assert "-> fast" in text and "needs the vendor library libfoo" in text
    assert "does not serve device type 'cpu'" in text and "outranked by 'fast'" in text
    reg.override("grouped_mm", "slow")
    assert reg.resolve("grouped_mm", "cpu")(torch.zeros(1, 1), torch.zeros(1, 1, 1), None)[0, 0] == 1
    with pytest.raises(OpError, match="known builders"):
        reg.override("grouped_mm", "nosuch")
    with pytest.raises(OpError, match="unknown op"):
        reg.resolve("nosuch_op", "cpu")


def test_builder_that_fails_to_load_falls_through():
    reg = OpRegistry()
    reg.add(OpBuilder("swiglu", "ok", ("cpu",), lambda: torch.mul, priority=1))

    def bad():
        raise ImportError("libkernels.so missing")

    reg.add(OpBuilder("swiglu", "bad", ("cpu",), bad, priority=2))
    assert reg.resolve("swiglu", "cpu") is torch.mul
    assert "libkernels.so missing" in reg.explain("swiglu", "cpu")


def test_env_override(monkeypatch):
    monkeypatch.setenv("POLYACCEL_OP_OVERRIDES", "fused_adam=reference")
    assert polyaccel.ops.registry.chosen("fused_adam", "cpu").name == "reference"
    monkeypatch.setenv("POLYACCEL_OP_OVERRIDES", "fused_adam")
    selection.reset()
    with pytest.raises(OpError, match="op=builder"):
        polyaccel.ops.registry.resolve("fused_adam", "cpu")


def test_third_party_builder_outranks_and_broken_op_hook_is_isolated():
    class Faster:
        POLYACCEL_API_VERSION = "1.0"

        @hookimpl
        def polyaccel_register_ops(self, registry):
            registry.register("quantize", "vendor_quant", ("cpu",), lambda: torch.mul, kind="vendor",
                              priority=50)

    class Broken:
        POLYACCEL_API_VERSION = "1.0"

        @hookimpl
        def polyaccel_register_ops(self, registry):
            registry.register("swiglu", "half_done", ("cpu",), lambda: torch.mul, priority=99)
            raise RuntimeError("kernel table corrupt")

    polyaccel.register_plugin("faster", Faster())
    polyaccel.register_plugin("broken", Broken())
    chosen = polyaccel.ops.registry.chosen("quantize", "cpu")
    assert chosen.name == "vendor_quant" and chosen.plugin == "faster"
    assert polyaccel.ops.registry.chosen("swiglu", "cpu").name == "reference"
    broken = selection.plugins().records["broken"]
    assert broken.status == "failed" and "kernel table corrupt" in broken.reason
    assert all(b.name != "half_done" for b in polyaccel.ops.registry.builders("swiglu"))


def test_explain_defaults_to_selected_device():
    assert "op 'fused_lion' on device type 'cpu'" in polyaccel.ops.explain("fused_lion")
