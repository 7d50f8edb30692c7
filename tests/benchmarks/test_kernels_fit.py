"""benchmarks/kernels_fit.py: the ladder's search and a real one-step trial on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kernels_fit  # noqa: E402


def test_the_ladder_doubles_then_bisects_once(monkeypatch):
    limit = 11  # batches above this "run out of memory"
    seen = []

    def fake_trial(system, args, batch):
        seen.append(batch)
        return {"batch": batch, "ok": batch <= limit}

    monkeypatch.setattr(kernels_fit, "trial", fake_trial)
    args = kernels_fit.parse(["--smoke"])
    args.start, args.max_batch, args.seq = 1, 64, 8
    out = kernels_fit.ladder("hf", args)
    assert seen == [1, 2, 4, 8, 16, 12]
    assert (out["largest_batch"], out["largest_tokens"], out["capped"]) == (8, 64, False)
    limit = 1000
    assert kernels_fit.ladder("hf", args)["capped"] is True


def test_a_trial_trains_one_step_and_an_error_is_a_failure(monkeypatch):
    args = kernels_fit.parse(["--smoke"])
    row = kernels_fit.trial("polyaccel+kernels", args, 2)
    assert row["ok"] and row["tokens"] == 2 * args.seq

    def no_memory(*a, **k):
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(kernels_fit, "make_step", no_memory)
    row = kernels_fit.trial("hf", args, 2)
    assert not row["ok"] and row["why"] == "device OOM"
