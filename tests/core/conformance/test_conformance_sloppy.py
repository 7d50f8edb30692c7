"""A deliberately broken plugin must be caught: FAIL rows with clear reasons, non-zero exit."""

from __future__ import annotations

from polyaccel.cli import main
from polyaccel.testing.conformance import results
from polyaccel.testing.distributions import temporary_distribution

#: a plugin that claims "graphs" but replays stale results, ships a swiglu builder using relu
#: instead of silu, and silently accepts host registration and streams although it claims neither.
#: Everything else about it is correct, so only those rows may fail. It also has a correct
#: grouped_mm builder below the reference that refuses float64 with a clear error.
SOURCE = '''
import contextlib
import os

import torch

from polyaccel.accelerator import Accelerator, ProbeResult
from polyaccel.hookspecs import hookimpl
from polyaccel.ops import OpBuilder
from polyaccel.ops.reference.swiglu import make_swiglu, swiglu_backward

POLYACCEL_API_VERSION = "1.0"


class StaleGraph:
    def __init__(self):
        self.captured = False

    def replay(self):
        if not self.captured:
            raise RuntimeError("graph replayed before capture")
        # the bug: nothing is re-run, the outputs keep the values computed during capture


class _NoStream:
    def wait_stream(self, other):
        pass


class SloppyAccelerator(Accelerator):
    name = "sloppy"
    device_type = "cpu"
    priority = -50

    def probe(self):
        return ProbeResult(True, "", 1)

    def capabilities(self):
        return frozenset({"rng", "fp64", "bf16", "graphs"})

    def device(self, index=None):
        return torch.device("cpu")

    def device_count(self):
        return 1

    def current_device(self):
        return 0

    def set_device(self, index):
        if index != 0:
            raise ValueError(index)

    def synchronize(self, index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def get_rng_state(self, index=None):
        return torch.get_rng_state()

    def set_rng_state(self, state, index=None):
        torch.set_rng_state(state)

    def create_graph(self):
        return StaleGraph()

    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None):
        yield graph
        graph.captured = True

    def replay_graph(self, graph):
        graph.replay()

    # not claimed, yet "works": silent no-ops
    def register_host_memory(self, tensor):
        return tensor

    def unregister_host_memory(self, tensor):
        return True

    def Stream(self, *args, **kwargs):
        return _NoStream()


def _relu_forward(gate, up):
    return (torch.relu(gate.float()) * up.float()).to(gate.dtype)


def _only_sloppy(acc):
    return isinstance(acc, SloppyAccelerator), "only for the sloppy accelerator"


@hookimpl
def polyaccel_accelerators():
    return [SloppyAccelerator]


def _grouped_mm_no_fp64(x, weight, offsets):
    # a correct kernel with a narrower dtype range, refusing the rest clearly
    if x.dtype == torch.float64:
        raise ValueError(f"sloppy_grouped_mm takes float32 and bfloat16, got {x.dtype}")
    from polyaccel.ops.reference import grouped_mm
    return grouped_mm(x, weight, offsets)


@hookimpl
def polyaccel_register_ops(registry):
    registry.add(OpBuilder(op="swiglu", name="sloppy_swiglu", device_types=("cpu",),
                           loader=lambda: make_swiglu(_relu_forward, swiglu_backward), priority=30,
                           compatible=_only_sloppy))
    # ranked below the reference: used only through an override
    registry.add(OpBuilder(op="grouped_mm", name="sloppy_grouped_mm", device_types=("cpu",),
                           loader=lambda: _grouped_mm_no_fp64, priority=-1, compatible=_only_sloppy))
'''


def test_sloppy_plugin_fails_where_it_is_broken(tmp_path, monkeypatch, capsys):
    root = tmp_path / "site"
    out = tmp_path / "sloppy.json"
    with temporary_distribution(root, "polyaccel-sloppy-plugin",
                                {"polyaccel.plugins": {"sloppy": "polyaccel_sloppy_plugin"}},
                                {"polyaccel_sloppy_plugin.py": SOURCE}):
        monkeypatch.setenv("PYTHONPATH", str(root))  # the suite runs in a child process
        rc = main(["conformance", "--accelerator", "sloppy", "--json", str(out), "-k", "not comm"])
    printed = capsys.readouterr().out
    assert rc == 1, printed
    assert "DOES NOT CONFORM" in printed
    doc = results.load(str(out))
    assert doc["ok"] is False and doc["error"] is None
    by_id = {r["id"]: r for r in doc["rows"]}
    failed = {r["id"] for r in doc["rows"] if r["status"] == "FAIL"}

    stale = by_id["capability/graphs/capture_replay_recomputes"]
    assert stale["status"] == "FAIL" and stale["claimed"] is True
    assert "stale replay" in stale["reason"], stale["reason"]

    noop = by_id["capability/host_register/register_use_unregister"]
    assert noop["status"] == "FAIL" and noop["claimed"] is False
    assert "silent no-op" in noop["reason"] and "register_host_memory" in noop["reason"], noop["reason"]

    streams = by_id["capability/streams/ordering"]
    assert streams["status"] == "FAIL" and "Stream()" in streams["reason"], streams["reason"]

    swiglu = [r for r in doc["rows"] if r["subject"] == "swiglu" and "sloppy_swiglu" in r["variant"]]
    assert {r["variant"].split()[-1] for r in swiglu} == {"float32", "bfloat16", "float64"}
    for r in swiglu:
        assert r["status"] == "FAIL" and "out of tolerance" in r["reason"], r

    # a builder only reachable through an override may refuse a dtype clearly: SKIPPED, with its words
    gmm = {r["variant"].split()[-1]: r for r in doc["rows"] if "sloppy_grouped_mm" in r["variant"]}
    assert {k: r["status"] for k, r in gmm.items()} == {"float32": "PASS", "bfloat16": "PASS", "float64": "SKIPPED"}
    assert "refuses torch.float64" in gmm["float64"]["reason"] and "takes float32" in gmm["float64"]["reason"]

    # nothing else is blamed: the rest of the plugin is correct
    expected = {stale["id"], noop["id"], streams["id"]} | {r["id"] for r in swiglu}
    assert failed == expected, sorted(failed ^ expected)
    assert by_id["capability/graphs/replay_without_capture_errors"]["status"] == "PASS"
    assert by_id["capability/rng/seed_reproducible_state_roundtrip"]["status"] == "PASS"
    assert by_id["capability/events/record_wait_query"]["status"] == "UNSUPPORTED"
