"""Emulated runtimes are found only through the ``polyaccel_emulated_runtimes`` hook: any plugin,
installed as a real distribution, can offer one; a broken offer is isolated with its reason."""

from __future__ import annotations

import os
import pkgutil

import polyaccel
import pytest
import torch
from polyaccel import selection
from polyaccel.cli import main
from polyaccel.testing import emulation
from polyaccel.testing.distributions import temporary_distribution
from polyaccel.testing.emulation import EmulationError, emulate, emulated_runtimes

IN_TREE = ("cpu", "cuda", "rocm", "npu", "xpu", "mps", "supa")

HEADER = '''
import types

from polyaccel.accelerator import Accelerator, ProbeResult
from polyaccel.hookspecs import hookimpl
from polyaccel.testing.emulation import EmulatedRuntime, mark_emulated

POLYACCEL_API_VERSION = "1.0"


class AcmeAccelerator(Accelerator):
    name = "acme"
    device_type = "acme"
    priority = -5

    def probe(self):
        import sys

        rt = sys.modules.get("acme_runtime")
        if rt is None:
            return ProbeResult(False, "acme_runtime is not installed")
        return ProbeResult(True, "", rt.device_count())

    def device_count(self):
        return 1

    def current_device(self):
        return 0

    def set_device(self, index):
        pass

    def synchronize(self, index=None):
        pass


class AcmeRuntime(EmulatedRuntime):
    name = "acme"
    accelerator = AcmeAccelerator

    def install(self, patcher):
        module = mark_emulated(types.ModuleType("acme_runtime"))
        module.device_count = lambda: self.record("device_count") and 1
        patcher.set_module("acme_runtime", module)


@hookimpl
def polyaccel_accelerators():
    return [AcmeAccelerator]
'''

OFFERS = HEADER + '''

@hookimpl
def polyaccel_emulated_runtimes():
    return [AcmeRuntime]
'''

RAISES = HEADER + '''

@hookimpl
def polyaccel_emulated_runtimes():
    raise RuntimeError("acme's emulation needs libacme-sim.so")
'''

ANSWERS_WRONG = HEADER + '''

@hookimpl
def polyaccel_emulated_runtimes():
    return "AcmeRuntime"
'''

#: a plugin without an accelerator that offers its own stand-in for the npu runtime
SHADOWS_NPU = '''
from polyaccel.hookspecs import hookimpl
from polyaccel.testing.emulation import EmulatedRuntime

POLYACCEL_API_VERSION = "1.0"


class OtherNpuRuntime(EmulatedRuntime):
    name = "npu"

    def install(self, patcher):
        pass


@hookimpl
def polyaccel_emulated_runtimes():
    return OtherNpuRuntime
'''


@pytest.fixture
def install(tmp_path, monkeypatch):
    """Install a plugin distribution for one test (also for the conformance suite's subprocess)."""
    stack = []

    def _install(dist_name, entry_name, source):
        module = f"pa_emu_{dist_name.replace('-', '_')}"
        root = tmp_path / dist_name
        cm = temporary_distribution(root, dist_name, {"polyaccel.plugins": {entry_name: module}},
                                    {f"{module}.py": source})
        cm.__enter__()
        stack.append(cm)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        selection.reset()

    yield _install
    for cm in reversed(stack):
        cm.__exit__(None, None, None)
    selection.reset()


def test_the_kit_holds_no_plugins_runtime_and_the_hook_finds_every_in_tree_one():
    kit = {m.name for m in pkgutil.iter_modules(emulation.__path__)}
    assert not kit & set(IN_TREE), f"vendor emulations belong in their plugins, not the kit: {kit & set(IN_TREE)}"
    catalog = emulated_runtimes()
    for name in ("npu", "supa", "xpu", "mps"):
        offer = catalog.offers[name]
        assert offer.plugin == name and offer.runtime.__module__ == f"polyaccel.plugins.{name}.emulation"
        assert offer.runtime.accelerator.name == name
    assert not catalog.broken


def test_a_third_party_plugin_offers_its_emulated_runtime(install):
    install("acme-polyaccel", "acme", OFFERS)
    assert selection.plugins().records["acme"].status == "unavailable"
    with emulate("acme") as rt:
        acc = polyaccel.set_accelerator("acme")
        assert type(acc).__name__ == "AcmeAccelerator" and acc.is_emulated()
        assert acc.probe().emulated and selection.plugins().records["acme"].emulated
        assert acc.device() == torch.device("cpu") and acc.on_accelerator(torch.ones(1))
        assert rt.calls.count_of("device_count") >= 1, "the probe must have asked the stand-in"
    assert selection.plugins().records["acme"].status == "unavailable"


def test_the_accelerator_is_emulated_only_while_the_runtime_is_active():
    from polyaccel.plugins.npu.accelerator import NpuAccelerator

    own_probe = NpuAccelerator.probe  # its own or inherited (polyaccel.vendor_extension.ExtensionAccelerator)
    with emulate("npu"):
        acc = NpuAccelerator()
        assert acc.is_emulated() and acc.device(0) == torch.device("cpu") and acc.on_accelerator(torch.ones(1))
    assert not acc.is_emulated() and not acc.on_accelerator(torch.ones(1))
    assert NpuAccelerator.probe is own_probe
    assert not {"is_emulated", "device", "on_accelerator"} & set(NpuAccelerator.__dict__), \
        "the production class defines none of the emulated behaviour"


@pytest.mark.parametrize("source,reason", [
    (RAISES, "polyaccel_emulated_runtimes raised RuntimeError: acme's emulation needs libacme-sim.so"),
    (ANSWERS_WRONG, "polyaccel_emulated_runtimes returned 'AcmeRuntime'"),
])
def test_a_broken_emulation_hook_is_isolated_with_its_reason(install, capsys, source, reason):
    install("acme-polyaccel", "acme", source)
    catalog = emulated_runtimes()
    assert reason in catalog.broken["acme"] and "acme" not in catalog.offers
    assert {"npu", "supa", "xpu", "mps"} <= set(catalog.offers), "the other plugins' offers stay usable"
    with pytest.raises(EmulationError) as err:
        emulate("acme")
    assert "no emulated runtime for plugin 'acme'" in str(err.value) and reason in str(err.value)
    with emulate("npu"):
        assert polyaccel.get_accelerator().name == "npu"
    assert main(["conformance", "--accelerator", "acme", "--emulate"]) == 2
    assert reason in capsys.readouterr().err
    # the plugin itself is untouched: only its emulated runtime is unusable
    assert selection.plugins().records["acme"].status == "unavailable"


def test_the_first_offer_for_a_name_wins_and_the_other_is_kept_aside(install):
    install("zz-npu-emulation", "npusim", SHADOWS_NPU)
    catalog = emulated_runtimes()
    assert catalog.offers["npu"].plugin == "npu"
    assert [(o.name, o.plugin) for o in catalog.shadowed] == [("npu", "npusim")]


def test_a_plugin_that_fails_to_load_is_named_when_its_runtime_is_missing(install):
    install("polyaccel-acme-broken", "acme", "raise ImportError('libacme.so: cannot open shared object file')\n")
    catalog = emulated_runtimes()
    assert "acme" in catalog.unloaded and "libacme.so" in catalog.unloaded["acme"]
    with pytest.raises(EmulationError, match=r"plugins that could not be loaded: acme \(failed: .*libacme\.so"):
        catalog.runtime("acme")
