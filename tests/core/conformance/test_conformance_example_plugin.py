"""The example third-party plugin: found through its entry point, selected only by name,
listed by `polyaccel report`, and conforming."""

from __future__ import annotations

import importlib.metadata as md
import json

import polyaccel
import pytest
from polyaccel import ops, selection
from polyaccel.cli import main
from polyaccel.testing.conformance import run_suite

DIST = "polyaccel-example-plugin"


def _installed() -> bool:
    try:
        md.distribution(DIST)
    except md.PackageNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _installed(), reason=f"{DIST} is not installed "
                                "(pip install ./examples/polyaccel-example-plugin)")


def test_discovered_through_its_entry_point():
    eps = [ep for ep in md.entry_points(group="polyaccel.plugins") if ep.name == "example"]
    assert [ep.value for ep in eps] == ["polyaccel_example_plugin"]
    assert eps[0].dist.name == DIST
    rec = selection.plugins().records["example"]
    assert rec.status == "available" and rec.priority < 0
    assert "entry point polyaccel_example_plugin" in rec.source


def test_never_auto_selected_and_never_hijacks_ops():
    acc = polyaccel.get_accelerator()
    assert acc.name != "example"
    if acc.device_type == "cpu":
        assert ops.registry.chosen("swiglu", "cpu").name != "example_swiglu"
        assert "serves only the 'example' accelerator" in ops.explain("swiglu", "cpu")


def test_selectable_by_name_and_its_builder_wins_then(monkeypatch):
    monkeypatch.setenv("POLYACCEL_ACCELERATOR", "example")
    acc = polyaccel.get_accelerator()
    assert type(acc).__name__ == "ExampleAccelerator" and acc.device_type == "cpu"
    assert ops.registry.chosen("swiglu", "cpu").name == "example_swiglu"


def test_listed_by_report(capsys):
    assert main(["report", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    example = [p for p in rep["plugins"] if p["name"] == "example"]
    assert example and example[0]["status"] == "available" and example[0]["priority"] < 0
    assert rep["extra"]["example"]["selected"] is False


def test_passes_conformance():
    run = run_suite("example")
    assert run.error() is None, run.output[-3000:]
    assert run.ok, [r for r in run.rows() if r["status"] == "FAIL"]
    rows = {r["id"]: r for r in run.rows()}
    assert rows["capability/graphs/capture_replay_recomputes"]["status"] == "PASS"
    assert rows["capability/graphs/replay_without_capture_errors"]["status"] == "PASS"
    swiglu = [r for r in run.rows() if r["subject"] == "swiglu"]
    assert swiglu and all("example_swiglu" in r["variant"] and r["status"] == "PASS" for r in swiglu)
    assert {r["variant"].split()[-1] for r in swiglu} == {"float32", "bfloat16", "float16", "float64"}


def test_ships_an_emulated_runtime_through_the_hook():
    from polyaccel.testing.emulation import emulate, emulated_runtimes

    offer = emulated_runtimes().offers["example"]
    assert offer.plugin == "example" and offer.runtime.__module__ == "polyaccel_example_plugin.emulation"
    with emulate("example") as rt:
        acc = polyaccel.set_accelerator("example")
        probe = acc.probe()
        assert probe.available and probe.emulated and acc.is_emulated()
        assert "example runtime 1.0+emulated" in probe.reason
        assert rt.calls.count_of("device_count") >= 1, "the probe must ask the (stand-in) runtime"
    with emulate("example", no_device=True):
        rec = selection.plugins().records["example"]
        assert rec.status == "unavailable" and "sees no device" in rec.reason


def test_conforms_under_its_emulated_runtime(capsys, tmp_path):
    out_json = tmp_path / "conformance.json"
    status = main(["conformance", "--accelerator", "example", "--emulate", "--json", str(out_json)])
    out = capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    assert status == 0, [r for r in doc["rows"] if r["status"] == "FAIL"]
    assert "conformance of 'example'" in out and "emulated" in out and "CONFORMS" in out
    assert doc["ok"] and doc["accelerator"]["emulated"] is True and all(r["emulated"] for r in doc["rows"])
    rows = {r["id"]: r for r in doc["rows"]}
    assert rows["capability/graphs/capture_replay_recomputes"]["status"] == "PASS"
