"""The runtime object, op builders returned by a hook, and per-accelerator answers (comm hooks, report facts)."""

from __future__ import annotations

import polyaccel
import pytest
import torch
from polyaccel import ConfigError, OpError, hookimpl, ops, selection
from polyaccel.accelerator import Accelerator, ProbeResult
from polyaccel.comm import CommHooks, resolve_hooks
from polyaccel.ops import OpBuilder, OpRegistry
from polyaccel.plugins.cpu.accelerator import CpuAccelerator
from polyaccel.report import build_report
from polyaccel.runtime import Runtime, current


def _builder(op, name, priority=50, fn=torch.mul):
    return OpBuilder(op, name, ("cpu",), lambda: fn, priority=priority)


class _Plugin:
    POLYACCEL_API_VERSION = "1.1"


# ------------------------------------------------------------------------ the runtime object
def test_the_public_entry_points_share_the_one_runtime():
    rt = current()
    assert polyaccel.ops.registry is rt.ops
    acc = polyaccel.get_accelerator()
    assert rt.selected is acc and selection.selected_or_none() is acc and rt.plugins() is selection.plugins()
    registry = rt.ops
    polyaccel.ops.registry.chosen("swiglu", "cpu")
    selection.reset()
    assert not rt.discovered and rt.selected is None
    assert rt.ops is registry and polyaccel.ops.registry is registry  # reset empties it, never replaces it
    assert registry.chosen("swiglu", "cpu").name == "reference"  # and it fills again on the next lookup


def test_a_runtime_of_its_own_leaves_the_process_runtime_alone():
    class Faster(_Plugin):
        @hookimpl
        def polyaccel_op_builders(self):
            return [_builder("swiglu", "private_swiglu", priority=90)]

    rt = Runtime()
    rt.register_plugin("private", Faster())
    assert rt.ops.chosen("swiglu", "cpu").name == "private_swiglu"
    assert rt.accelerator().name == "cpu" and rt.selected is not current().selected
    assert polyaccel.ops.registry.chosen("swiglu", "cpu").name == "reference"
    assert "private" not in selection.plugins().records


def test_explain_takes_the_device_type_from_the_lookup_it_was_given():
    class Meta(CpuAccelerator):
        device_type = "meta"

    asked = []

    def lookup(device_type):
        asked.append(device_type)
        return Meta()

    reg = OpRegistry(lookup)
    reg.add(OpBuilder("swiglu", "anywhere", ("*",), lambda: torch.mul))
    assert reg.explain("swiglu").startswith("op 'swiglu' on device type 'meta':")
    assert asked[0] is None and not current().discovered  # no process-wide selection behind its back
    with pytest.raises(OpError, match="no accelerator to take the device type from; pass device_type"):
        OpRegistry().explain("swiglu")


# ------------------------------------------------------------------------------- op builders
def test_builders_returned_by_the_hook_are_used_and_stamped_with_their_plugin():
    class Vendor(_Plugin):
        @hookimpl
        def polyaccel_op_builders(self):
            return [_builder("quantize", "vendor_quantize", 60), _builder("swiglu", "vendor_swiglu", 60)]

    polyaccel.register_plugin("vendor", Vendor())
    chosen = ops.registry.chosen("quantize", "cpu")
    assert chosen.name == "vendor_quantize" and chosen.plugin == "vendor"
    rec = selection.plugins().records["vendor"]
    assert rec.status == "loaded" and "vendor_quantize (quantize), vendor_swiglu (swiglu)" in rec.reason


@pytest.mark.parametrize("answer,reason", [
    (RuntimeError("kernel table corrupt"), "polyaccel_op_builders raised RuntimeError: kernel table corrupt"),
    ([_builder("swiglu", "fine"), "not a builder"],
     "its op hook gave str 'not a builder', not a polyaccel.ops.OpBuilder"),
    ([_builder("swiglu", "twice"), _builder("swiglu", "twice")],
     "op 'swiglu' already has a builder named 'twice' (from this plugin)"),
    ([_builder("swiglu", "fine"), _builder("fused_adam", "cpu_fused_adam")],
     "op 'fused_adam' already has a builder named 'cpu_fused_adam' (from plugin 'cpu')"),
])
def test_a_plugin_whose_builders_are_unusable_is_isolated_with_all_its_builders(answer, reason):
    class Vendor(_Plugin):
        @hookimpl
        def polyaccel_accelerators(self):
            return [type("VendorAcc", (CpuAccelerator,), {"name": "vendoracc", "priority": 99})]

        @hookimpl
        def polyaccel_op_builders(self):
            if isinstance(answer, Exception):
                raise answer
            return answer

    class Neighbour(_Plugin):
        @hookimpl
        def polyaccel_op_builders(self):
            return [_builder("quantize", "neighbour_quantize")]

    polyaccel.register_plugin("vendor", Vendor())
    polyaccel.register_plugin("neighbour", Neighbour())
    assert polyaccel.get_accelerator().name == "cpu"  # priority 99, but isolated
    rec = selection.plugins().records["vendor"]
    assert rec.status == "failed" and reason in rec.reason and "isolated" in rec.reason
    assert not any(b.plugin == "vendor" for op in ops.registry.ops() for b in ops.registry.builders(op))
    assert ops.registry.chosen("quantize", "cpu").name == "neighbour_quantize"  # the neighbour is not affected
    assert reason in ops.registry.plugin_failures()["vendor"]["reason"]
    assert ops.registry.chosen("fused_adam", "cpu").name == "cpu_fused_adam"


def test_the_contract_1_0_hook_still_adds_builders_and_fails_all_or_nothing():
    class Old:
        POLYACCEL_API_VERSION = "1.0"

        @hookimpl
        def polyaccel_register_ops(self, registry):
            registry.add(_builder("quantize", "old_quantize", 70))
            registry.register("swiglu", "old_swiglu", ("cpu",), lambda: torch.mul, priority=70)

    class Both(_Plugin):
        @hookimpl
        def polyaccel_op_builders(self):
            return [_builder("grouped_mm", "both_returned", 70)]

        @hookimpl
        def polyaccel_register_ops(self, registry):
            registry.add(_builder("grouped_mm", "both_added", 80))
            raise RuntimeError("half way")

    polyaccel.register_plugin("old", Old())
    polyaccel.register_plugin("both", Both())
    assert ops.registry.chosen("quantize", "cpu").name == "old_quantize"
    assert ops.registry.chosen("swiglu", "cpu").plugin == "old"
    failure = ops.registry.plugin_failures()["both"]
    assert failure["reason"] == "polyaccel_register_ops raised RuntimeError: half way"
    assert failure["dropped_builders"] == ["both_returned (grouped_mm)", "both_added (grouped_mm)"]
    assert ops.registry.chosen("grouped_mm", "cpu").name == "reference"


# ------------------------------------------------------------------ comm hooks and report facts
class _Host(Accelerator):
    name = "host"
    device_type = "cpu"
    priority = -1

    def probe(self):
        return ProbeResult(True, "", 1)


class _Answering(_Host):
    name = "answering"

    def comm_hooks(self):
        return CommHooks(backend="gloo", emulated_collectives={"all_to_all_single"})

    def report_facts(self):
        return {"firmware": "4.2"}


class _Raising(_Host):
    name = "raising"

    def report_facts(self):
        raise RuntimeError("firmware query failed")


class _Unavailable(_Host):
    name = "unavailable"

    def probe(self):
        return ProbeResult(False, "no board", 0)

    def report_facts(self):
        return {"why": "the driver is missing"}


class _Accelerators(_Plugin):
    @hookimpl
    def polyaccel_accelerators(self):
        return [_Answering, _Raising, _Unavailable]


def test_comm_hooks_are_the_accelerators_own_unless_a_plugin_overrides_them():
    assert resolve_hooks(_Host()) == CommHooks(backend="gloo")
    assert resolve_hooks(_Answering()).emulated_collectives == {"all_to_all_single"}

    class Override(_Plugin):
        @hookimpl
        def polyaccel_comm_hooks(self, accelerator):
            return CommHooks(backend="vendorccl") if accelerator.name == "answering" else None

    selection.reset()  # a plugin registered later is used from the next discovery on
    polyaccel.register_plugin("override", Override())
    assert resolve_hooks(_Answering()).backend == "vendorccl"
    assert resolve_hooks(_Host()).backend == "gloo"

    class Wrong(_Host):
        def comm_hooks(self):
            return "gloo"

    with pytest.raises(ConfigError, match=r"Wrong.comm_hooks\(\) returned str; return a polyaccel.comm.CommHooks"):
        resolve_hooks(Wrong())


def test_report_facts_come_from_each_accelerator_and_report_hooks_from_each_plugin():
    class Library(_Plugin):
        @hookimpl
        def polyaccel_report(self, accelerator):
            return {"library": "vendorlib 3", "for": accelerator.name}

    class BrokenLibrary(_Plugin):
        @hookimpl
        def polyaccel_report(self, accelerator):
            raise RuntimeError("vendorlib missing")

    polyaccel.register_plugin("accelerators", _Accelerators())
    polyaccel.register_plugin("library", Library())
    polyaccel.register_plugin("brokenlib", BrokenLibrary())
    extra = build_report()["extra"]
    assert extra["accelerators"] == {"firmware": "4.2"}  # not selected, still described
    assert extra["raising"] == {"error": "RuntimeError: firmware query failed"}
    assert extra["unavailable"] == {"why": "the driver is missing"}  # an unusable one can say why
    assert extra["library"] == {"library": "vendorlib 3", "for": "cpu"}  # about the selected accelerator
    assert extra["brokenlib"] == {"error": "RuntimeError: vendorlib missing"}
    polyaccel.set_accelerator("answering")
    assert build_report()["selected"]["comm"]["emulated_collectives"] == {
        "all_to_all_single": "batched isend/irecv of the splits"}


def test_no_in_tree_plugin_answers_broadcast_comm_or_report_hooks():
    """What concerns one accelerator is its method; nothing is left that must filter by accelerator."""
    import importlib

    for name in ("cpu", "cuda", "rocm", "npu", "xpu", "mps", "supa"):
        plugin = importlib.import_module(f"polyaccel.plugins.{name}")
        assert not hasattr(plugin, "polyaccel_comm_hooks") and not hasattr(plugin, "polyaccel_report"), name
        assert not hasattr(plugin, "polyaccel_register_ops") and name, name
