"""`--emulate` runs the suite inside a plugin's emulated runtime and labels every row "emulated"."""

from __future__ import annotations

from polyaccel.testing.conformance import run_suite
from polyaccel.testing.conformance.target import available_emulations


def test_emulated_run_is_labelled_and_conforms():
    names = available_emulations()
    assert names, "no installed plugin offers an emulated runtime (hook polyaccel_emulated_runtimes)"
    name = names[0]
    run = run_suite(name, emulate=True)
    assert run.error() is None, run.output[-3000:]
    doc = run.document
    assert doc["accelerator"]["name"] == name and doc["accelerator"]["emulated"] is True
    assert doc["rows"] and all(r["emulated"] is True for r in doc["rows"])
    comm = [r for r in doc["rows"] if r["area"] == "comm"]
    assert comm and all(r["status"] == "SKIPPED" and "emulated" in r["reason"] for r in comm)
    assert run.ok, [r for r in doc["rows"] if r["status"] == "FAIL"]
