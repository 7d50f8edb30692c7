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


def _fake_suite(monkeypatch, body: str) -> None:
    """The suite's process replaced by a script that gets the same trailing progress option (its fd last)."""
    import sys

    script = "import json, os, sys, time\nevents = os.fdopen(int(sys.argv[-1]), 'w', buffering=1)\n" + body
    monkeypatch.setattr(runner, "pytest_command", lambda *a, **k: [sys.executable, "-c", script])


def test_a_run_past_its_timeout_names_the_check_it_was_on(monkeypatch, capsys):
    """A killed run says which check was running, how many were done, and what it printed last."""
    _fake_suite(monkeypatch, (
        "for e in ({'total': 3}, {'start': 'test_device.py::test_x'}, {'finish': 'test_device.py::test_x'},\n"
        "          {'start': 'test_ops.py::test_vs_reference[moe_gate_up]'}):\n"
        "    events.write(json.dumps(e) + '\\n')\n"
        "print('compiling', flush=True)\ntime.sleep(60)\n"))
    assert main(["conformance", "--accelerator", "cpu", "--timeout", "3"]) == 2
    err = capsys.readouterr().err
    assert ("did not finish within 3.0 s: it was running test_ops.py::test_vs_reference[moe_gate_up] "
            "(1 of 3 checks done)") in err
    assert "the last it printed:\ncompiling" in err
    _fake_suite(monkeypatch, "time.sleep(60)\n")
    assert main(["conformance", "--accelerator", "cpu", "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert "it had not finished collecting the checks" in err and "it printed nothing" in err


def test_progress_follows_every_check_of_a_real_run():
    seen = []
    run = runner.run_suite("cpu", keyword="moe or swiglu",
                           progress=lambda p: seen.append((p.total, p.done, p.running)))
    rows = run.rows()
    assert run.ok and len(rows) >= 2
    total = seen[-1][0]
    assert total == len(rows) and seen[-1][1:] == (total, None)
    started = [r for _, _, r in seen if r is not None]
    assert len(set(started)) == total and all("::" in r for r in started)
    assert "--polyaccel-progress-fd" not in " ".join(run.command)  # the reported command can be run again


def test_a_terminal_gets_a_progress_bar_that_leaves_only_the_table(monkeypatch, capsys):
    import sys

    from polyaccel.cli import conformance_cmd

    updates = []
    real = conformance_cmd._progress_shown

    @contextlib.contextmanager
    def spying():
        with real() as show:
            assert show is not None  # a terminal: the bar is up
            yield lambda run: updates.append(run.done) or show(run)

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(conformance_cmd, "_progress_shown", spying)
    assert main(["conformance", "--accelerator", "cpu", "-k", "moe"]) == 0
    out = capsys.readouterr()
    assert updates and updates[-1] >= 2 and "CONFORMS" in out.out


def test_a_progress_fd_that_is_not_open_is_a_usage_error(tmp_path):
    import subprocess
    import sys

    cmd = runner.pytest_command("cpu", keyword="moe", ini_path=str(tmp_path / "pytest.ini"))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    proc = subprocess.run(cmd + [runner.PROGRESS_OPTION, "987"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "--polyaccel-progress-fd 987 is not a file descriptor open for writing" in proc.stderr
    assert sys.executable in cmd[0]
