"""benchmarks/zero_gpu.py --isolate --rounds: how a row's rounds become one row of the table."""

from __future__ import annotations

import pathlib
import random
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import zero_gpu  # noqa: E402


def _row(name, ms, peak):
    return {"config": name, "step_ms": ms, "tokens_per_s": 8192 * 1000 / ms, "peak_gib": peak, "first_loss": 10.5}


def test_rounds_are_averaged_per_row_in_row_order():
    rng = random.Random()
    a_ms = [rng.uniform(50, 120) for _ in range(3)]
    b_ms = [rng.uniform(50, 120) for _ in range(3)]
    peaks = [rng.uniform(5, 10) for _ in range(3)]
    runs = {"b": [_row("b", ms, 7.0) for ms in b_ms],
            "a": [_row("a", ms, p) for ms, p in zip(a_ms, peaks, strict=True)]}
    rows = zero_gpu.merge_rounds(["a", "skipped", "b", "bad"], runs, {"bad": "exit 1"})
    assert [r["config"] for r in rows] == ["a", "b", "bad"]
    a, b, bad = rows
    assert a["step_ms"] == pytest.approx(sum(a_ms) / 3) and a["round_ms"] == a_ms
    assert a["tokens_per_s"] == pytest.approx(8192 * 1000 / a["step_ms"])
    assert a["peak_gib"] == max(peaks) and a["first_loss"] == 10.5
    assert b["step_ms"] == pytest.approx(sum(b_ms) / 3)
    assert bad == {"config": "bad", "error": "exit 1"}


def test_rounds_need_isolate_and_a_positive_count(monkeypatch, capsys):
    for argv, message in ((["--rounds", "2"], "--rounds needs --isolate"),
                          (["--isolate", "--rounds", "0"], "--rounds must be at least 1")):
        monkeypatch.setattr(sys, "argv", ["zero_gpu.py", *argv])
        with pytest.raises(SystemExit):
            zero_gpu.main()
        assert message in capsys.readouterr().err
