"""The example plugin's own tests: what a third-party plugin should ship.

Run with ``pytest examples/polyaccel-example-plugin/tests`` after installing the package.
Two tests run polyaccel's conformance suite against the plugin: as installed, and under its
emulated runtime.
"""

from __future__ import annotations

import polyaccel
import pytest
import torch
from polyaccel import selection
from polyaccel.ops import registry
from polyaccel.ops.reference import swiglu as reference_swiglu
from polyaccel_example_plugin.accelerator import ExampleAccelerator


@pytest.fixture(autouse=True)
def fresh_selection(monkeypatch):
    monkeypatch.delenv("POLYACCEL_ACCELERATOR", raising=False)
    selection.reset()
    yield
    selection.reset()


def test_graph_replay_recomputes_from_the_static_inputs():
    acc = ExampleAccelerator()
    x, w = torch.randn(100), torch.randn(100)
    graph = acc.create_graph()
    with acc.capture_to_graph(graph):
        y = torch.relu(x * w) + 1.0
    x.copy_(torch.randn(100))
    acc.replay_graph(graph)
    torch.testing.assert_close(y, torch.relu(x * w) + 1.0)


def test_replay_before_capture_is_an_error():
    acc = ExampleAccelerator()
    with pytest.raises(polyaccel.PolyaccelError, match="never captured"):
        acc.replay_graph(acc.create_graph())


def test_unclaimed_features_raise_unsupported():
    acc = ExampleAccelerator()
    for call in (acc.Stream, lambda: acc.register_host_memory(torch.ones(4)), acc.memory_allocated):
        with pytest.raises(polyaccel.Unsupported) as err:
            call()
        assert err.value.plugin == "example"


def test_swiglu_builder_serves_only_the_selected_example_accelerator():
    assert polyaccel.get_accelerator().name != "example"  # priority -10: never auto-selected
    assert registry.chosen("swiglu", "cpu").name != "example_swiglu"
    selection.reset()
    polyaccel.set_accelerator("example")
    assert registry.chosen("swiglu", "cpu").name == "example_swiglu"
    gate = torch.randn(7, 9, requires_grad=True)
    up = torch.randn(7, 9, requires_grad=True)
    polyaccel.ops.swiglu(gate, up).sum().backward()
    g_ref, u_ref = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    reference_swiglu(g_ref, u_ref).sum().backward()
    torch.testing.assert_close(gate.grad, g_ref.grad)
    torch.testing.assert_close(up.grad, u_ref.grad)


def test_passes_the_conformance_suite():
    from polyaccel.testing.conformance import run_suite

    run = run_suite("example")
    assert run.error() is None, run.output[-3000:]
    assert run.ok, [r for r in run.rows() if r["status"] == "FAIL"]


def test_probe_asks_the_runtime_under_the_emulated_runtime():
    """The plugin's emulated runtime (offered through polyaccel_emulated_runtimes) stands in for the vendor's."""
    from polyaccel.testing.emulation import emulate

    with emulate("example") as rt:
        probe = ExampleAccelerator().probe()
        assert probe.available and probe.emulated and "example runtime" in probe.reason
        assert rt.calls.names() == ["device_count"]
    with emulate("example", no_device=True):
        probe = ExampleAccelerator().probe()
        assert not probe.available and "sees no device" in probe.reason
    assert not ExampleAccelerator().probe().emulated


def test_passes_the_conformance_suite_under_its_emulated_runtime():
    from polyaccel.testing.conformance import run_suite

    run = run_suite("example", emulate=True)
    assert run.error() is None, run.output[-3000:]
    assert run.ok and run.document["accelerator"]["emulated"], [r for r in run.rows() if r["status"] == "FAIL"]


def test_host_defaults_come_from_the_base_class():
    """The accelerator defines no device or RNG methods: polyaccel's host defaults serve it."""
    acc = ExampleAccelerator()
    assert acc.device() == torch.device("cpu") and acc.device_count() == 1 and acc.current_device() == 0
    acc.set_device(0)
    with pytest.raises(ValueError, match="one host device per process"):
        acc.set_device(5)
    acc.manual_seed(7)
    first = torch.randn(5)
    acc.manual_seed(7)
    assert torch.equal(first, torch.randn(5))
    assert acc.is_synchronized_device()
