"""benchmarks/zero_largest.py: the ladder search, the trial watchdog and a --quick run on the CPU."""

from __future__ import annotations

import json
import pathlib
import random
import re
import sys
from types import SimpleNamespace

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import zero_largest  # noqa: E402


def _limit_trial(limit, tried):
    def trial(layers):
        tried.append(layers)
        return layers <= limit
    return trial


def test_search_finds_the_limit_from_below_and_above_to_the_resolution():
    rng = random.Random()
    for _ in range(50):
        limit, start, res = rng.randint(1, 80), rng.randint(1, 80), rng.choice([1, 2, 3])
        tried = []
        good, bad = zero_largest.search(_limit_trial(limit, tried), start, res)
        assert good <= limit and good > limit - res, (limit, start, res, good, tried)
        assert bad is not None and bad > limit and bad - good <= res
        assert len(tried) == len(set(tried))  # no rung run twice


def test_search_respects_the_cap_and_the_budget():
    tried = []
    assert zero_largest.search(_limit_trial(100, tried), 5, 1, max_layers=9) == (9, None)
    assert tried[-1] == 9
    calls = []
    good, bad = zero_largest.search(_limit_trial(40, calls), 10, 1, out_of_time=lambda: len(calls) >= 2)
    assert calls == [10, 11] and (good, bad) == (11, None)


def test_llama_params_match_the_hf_model():
    model = zero_largest.build_model(2, 128, 16, __import__("torch").float32)
    assert sum(p.numel() for p in model.parameters()) == zero_largest.llama_params(2, 128)
    per_layer = zero_largest.llama_params(1, 4096) - zero_largest.llama_params(0, 4096)
    assert zero_largest.predicted_layers("polyaccel", 4096, 16 * (zero_largest.llama_params(0, 4096)
                                                                  + 10 * per_layer)) == 10


def _args(**kw):
    base = dict(hidden=64, seq=16, batch=1, steps=1, trial_timeout=60.0, host_margin_gib=0.0)
    return SimpleNamespace(**{**base, **kw})


def test_a_trial_over_its_time_or_the_host_margin_fails_with_the_reason():
    t = zero_largest.run_trial(_args(trial_timeout=0.3), "polyaccel", 1)
    assert not t.ok and t.why.startswith("timeout after")
    t = zero_largest.run_trial(_args(host_margin_gib=1e9), "polyaccel", 1)
    assert not t.ok and t.why.startswith("host OOM: available host memory fell")


def test_a_timeout_names_the_phase_it_cut_short():
    t = zero_largest.run_trial(_args(trial_timeout=15.0, steps=100_000), "polyaccel", 1)
    assert not t.ok and re.fullmatch(r"timeout after 15 s \(cut in step \d+ of 100000 at \d+ s\)", t.why), t.why


def test_quick_ladder_trains_and_reports(tmp_path, capsys):
    out = tmp_path / "largest.json"
    assert zero_largest.main(["--quick", "--max-layers", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["results"]["polyaccel"]["largest_layers"] == 1 and data["common_layers"] == 1
    trials = data["trials"]
    assert [t["layers"] for t in trials] == [1] and all(t["ok"] for t in trials)
    assert all(t["step_ms"] > 0 and t["host_peak_gib"] > 0.05 for t in trials)
    assert data["step_ms_at_common"]["polyaccel"] == trials[-1]["step_ms"]
    assert "largest trained: 1 layers" in capsys.readouterr().out
