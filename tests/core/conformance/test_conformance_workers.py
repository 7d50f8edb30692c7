"""POLYACCEL_CONFORMANCE_WORKERS: the suite's checks in several pytest-xdist processes (a fresh GPU compiles
its kernels in parallel), the document written once by the controller with every row."""

from __future__ import annotations

import pytest
from polyaccel.errors import ConfigError
from polyaccel.testing.conformance import runner


def test_workers_from_env_and_the_command():
    assert runner.workers_from_env({}) == 1
    assert runner.workers_from_env({runner.WORKERS_ENV: "0"}) == 1
    assert runner.workers_from_env({runner.WORKERS_ENV: " 3 "}) == 3
    assert "-n" not in runner.pytest_command("cpu")
    cmd = runner.pytest_command("cpu", workers=3)
    assert cmd[cmd.index("-n") + 1] == "3"
    for bad in ("two", "-1", "1.5"):
        with pytest.raises(ConfigError, match=runner.WORKERS_ENV):
            runner.workers_from_env({runner.WORKERS_ENV: bad})


def test_xdist_missing_is_refused(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "xdist" else real(name, *a))
    with pytest.raises(ConfigError, match="pytest-xdist"):
        runner.workers_from_env({runner.WORKERS_ENV: "2"})


def test_two_workers_give_the_rows_of_one(monkeypatch):
    pytest.importorskip("xdist")
    serial = runner.run_suite("cpu", keyword="device", timeout=300)
    monkeypatch.setenv(runner.WORKERS_ENV, "2")
    parallel = runner.run_suite("cpu", keyword="device", timeout=300)
    assert "-n" in parallel.command and "-n" not in serial.command
    assert serial.ok and parallel.ok, (serial.error(), parallel.error())
    rows = lambda run: sorted((r["id"], r["status"]) for r in run.rows())  # noqa: E731
    assert rows(parallel) == rows(serial) and len(rows(serial)) >= 5
