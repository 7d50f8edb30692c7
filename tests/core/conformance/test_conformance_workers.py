"""--workers / POLYACCEL_CONFORMANCE_WORKERS: the suite's checks in several pytest-xdist processes (a fresh GPU compiles
its kernels in parallel), the document written once by the controller with every row."""

from __future__ import annotations

import pytest
from polyaccel.errors import ConfigError
from polyaccel.testing.conformance import runner


def test_workers_from_env_and_the_command():
    assert runner.workers_from_env({}) is None
    assert runner.workers_from_env({runner.WORKERS_ENV: "0"}) == 1
    assert runner.workers_from_env({runner.WORKERS_ENV: " 3 "}) == 3
    assert "-n" not in runner.pytest_command("cpu")
    cmd = runner.pytest_command("cpu", workers=3)
    assert cmd[cmd.index("-n") + 1] == "3"
    for bad in ("two", "-1", "1.5"):
        with pytest.raises(ConfigError, match=runner.WORKERS_ENV):
            runner.workers_from_env({runner.WORKERS_ENV: bad})


def test_the_count_asked_for_then_the_variable_then_one_per_four_cpus(monkeypatch):
    monkeypatch.setattr(runner, "_has_xdist", lambda: True)
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 16)
    assert runner.resolve_workers(None, {}) == 4  # an H100 host of 16 CPUs
    assert runner.resolve_workers(None, {runner.WORKERS_ENV: "2"}) == 2
    assert runner.resolve_workers(0, {runner.WORKERS_ENV: "3"}) == 1  # --workers wins over the variable
    assert [runner.auto_workers(c) for c in (1, 2, 7, 8, 15, 64, 256)] == [1, 1, 1, 2, 3, 4, 4]
    with pytest.raises(ConfigError, match="--workers -2"):
        runner.resolve_workers(-2, {})
    monkeypatch.setattr(runner, "_has_xdist", lambda: False)
    assert runner.resolve_workers(None, {}) == 1  # no pytest-xdist: one process, not an error
    with pytest.raises(ConfigError, match="--workers 3.*pytest-xdist"):
        runner.resolve_workers(3, {})


def test_xdist_missing_is_refused(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "xdist" else real(name, *a))
    with pytest.raises(ConfigError, match="pytest-xdist"):
        runner.workers_from_env({runner.WORKERS_ENV: "2"})


@pytest.mark.parametrize("given, said", [(["--workers", "two"], "'two' is not a whole number"),
                                         (["--workers", "-1"], "give 0 or more")])
def test_cli_refuses_a_bad_worker_count(given, said, capsys):
    from polyaccel.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["conformance", "--accelerator", "cpu", *given])
    assert exc.value.code == 2 and said in capsys.readouterr().err


def test_cli_names_a_bad_variable_without_a_traceback(monkeypatch, capsys):
    from polyaccel.cli import main

    monkeypatch.setenv(runner.WORKERS_ENV, "many")
    assert main(["conformance", "--accelerator", "cpu"]) == 2
    assert f"{runner.WORKERS_ENV}='many' is not a whole number" in capsys.readouterr().err


def test_two_workers_give_the_rows_of_one(monkeypatch):
    pytest.importorskip("xdist")
    monkeypatch.setenv(runner.WORKERS_ENV, "1")
    serial = runner.run_suite("cpu", keyword="device", timeout=300)
    parallel = runner.run_suite("cpu", keyword="device", timeout=300, workers=2)
    assert "-n" in parallel.command and "-n" not in serial.command
    assert serial.ok and parallel.ok, (serial.error(), parallel.error())
    rows = lambda run: sorted((r["id"], r["status"]) for r in run.rows())  # noqa: E731
    assert rows(parallel) == rows(serial) and len(rows(serial)) >= 5
