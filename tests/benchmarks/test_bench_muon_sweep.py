"""benchmarks/bench_muon.py's sweep of ZeRO's Newton-Schulz batches, on the CPU under the Triton interpreter at tiny
shapes: every tile is run on every batch (square, tall, wide), its result is compared with the default tile's, and
a wrong result is never reported as the best tile."""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

SHAPES = {"220m": [(2, 48, 32), (2, 32, 48)]}
TILES = [(32, 32, 32, 4, 3, 8), (16, 32, 16, 4, 3, 8)]


@pytest.fixture
def bench(monkeypatch):
    import bench_muon

    monkeypatch.setattr(bench_muon, "ZERO_SHAPES", {"220m": [(2, 16, 32)]})
    monkeypatch.setattr(bench_muon, "ZERO_SWEEP_SHAPES", SHAPES)
    monkeypatch.setattr(bench_muon, "ZERO_SWEEP", TILES)
    return bench_muon


def _fake_times(bench, monkeypatch, result_of_tile):
    """time_ms runs the call once and says 1 ms; newton_schulz counts its calls by tile and hands its result
    through ``result_of_tile(tile, result)``. Returns the counts."""
    kns = importlib.import_module("polyaccel.plugins.cuda.kernels.newton_schulz")

    def time_ms(fn, **_):
        fn()
        return 1.0

    calls = {}
    real = kns.newton_schulz

    def newton_schulz(x, **kw):
        calls.setdefault(kw.get("config"), 0)
        calls[kw.get("config")] += 1
        return result_of_tile(kw.get("config"), real(x, **kw))

    monkeypatch.setattr(bench, "time_ms", time_ms)
    monkeypatch.setattr(kns, "newton_schulz", newton_schulz)
    return calls


def test_sweep_runs_every_tile_on_every_batch_and_checks_its_result(bench, monkeypatch):
    calls = _fake_times(bench, monkeypatch, lambda tile, out: out)
    rows = []
    bench.bench_zero_shapes(argparse.Namespace(sweep=True), "cpu", rows)
    kns = importlib.import_module("polyaccel.plugins.cuda.kernels.newton_schulz")
    for tile in TILES:
        assert calls[kns.TileConfig(*tile)] == 2 * len(SHAPES["220m"])  # its result, then its time, per batch
    best = [r for r in rows if "best swept tile" in r.case]
    assert [r.case.split(":")[0] for r in best] == ["ZeRO 220m batch 2 x 48x32", "ZeRO 220m batch 2 x 32x48"]


def test_a_tile_with_a_wrong_result_is_never_the_best(bench, monkeypatch):
    kns = importlib.import_module("polyaccel.plugins.cuda.kernels.newton_schulz")
    bad = kns.TileConfig(*TILES[1])

    def corrupt(tile, out):
        if tile == bad:
            out.mul_(1.5)  # a tile that computes something else
        return out

    _fake_times(bench, monkeypatch, corrupt)
    timings = iter([3.0, 2.0, 1.0] * len(SHAPES["220m"]))  # default, good tile, then the wrong tile the fastest
    monkeypatch.setattr(bench, "time_ms", lambda fn, **_: (fn(), next(timings))[1])
    rows = []
    bench._sweep_zero_shapes(kns, "220m", "cpu", rows)
    for r in rows:
        assert str(kns.TileConfig(*TILES[0])) in r.case and r.ours == 2.0, r.case
    assert len(rows) == len(SHAPES["220m"])
