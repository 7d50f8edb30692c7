"""`polyaccel conformance` explains why it could not run, with exit status 2."""

from __future__ import annotations

import contextlib

import pytest
from polyaccel.cli import main
from polyaccel.testing.conformance import runner
from polyaccel.testing.conformance.target import TargetError, enter_emulation, select_target


def test_emulate_without_an_emulated_runtime(capsys):
    assert main(["conformance", "--accelerator", "cpu", "--emulate"]) == 2
    err = capsys.readouterr().err
    assert "no emulated runtime for plugin 'cpu'" in err
    assert "polyaccel_emulated_runtimes hook" in err and "npu (plugin npu)" in err


def test_emulate_needs_a_name():
    with contextlib.ExitStack() as stack, pytest.raises(TargetError, match="needs the accelerator's name"):
        enter_emulation(stack, None)


def test_unknown_accelerator_lists_what_is_installed():
    with pytest.raises(TargetError) as err:
        select_target("no-such-device")
    assert "no accelerator plugin named 'no-such-device'" in str(err.value) and "cpu" in str(err.value)


def test_nothing_selected_is_not_a_pass(monkeypatch, capsys):
    doc = {"ok": False, "error": "no conformance check was selected", "exit_status": 5, "rows": [],
           "accelerator": None, "counts": {}}
    monkeypatch.setattr(runner, "run_suite",
                        lambda *a, **k: runner.SuiteRun(document=doc, returncode=5, output="", command=[]))
    assert main(["conformance", "--accelerator", "cpu", "-k", "nothing_has_this_name"]) == 2
    assert "no check ran (nothing matched -k 'nothing_has_this_name')" in capsys.readouterr().err


def test_a_run_past_its_timeout_names_where_it_stopped(monkeypatch, capsys):
    """A killed run reports what it printed last (with -v: the check that was running), not just the limit."""
    import sys

    script = "print('test_ops.py::test_vs_reference[moe_gate_up] ', flush=True); import time; time.sleep(60)"
    monkeypatch.setattr(runner, "pytest_command", lambda *a, **k: [sys.executable, "-c", script])
    assert main(["conformance", "--accelerator", "cpu", "-v", "--timeout", "3"]) == 2
    err = capsys.readouterr().err
    assert "did not finish within 3.0 s" in err
    assert "the last it printed:\ntest_ops.py::test_vs_reference[moe_gate_up]" in err
    monkeypatch.setattr(runner, "pytest_command", lambda *a, **k: [sys.executable, "-c", "import time; time.sleep(60)"])
    assert main(["conformance", "--accelerator", "cpu", "--timeout", "2"]) == 2
    assert "it printed nothing; -v names each check as it runs" in capsys.readouterr().err
