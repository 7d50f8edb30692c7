"""benchmarks/autosp_gpu.py refuses what cannot run before any row (sp above the ranks or the GPUs, sp not dividing
the ranks, the heads or a length), and zero_gpu.py --sp1 adds the AutoSP-at-1 row after each polyaccel row."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import autosp_gpu  # noqa: E402
import zero_gpu  # noqa: E402


@pytest.mark.parametrize("argv, world, gpus, words", [
    (["--sp", "1,2,4,8"], 4, 4, "--sp 8 needs more ranks than this run has: 4 rank(s) (torchrun --nproc-per-node 4)"),
    (["--sp", "1,2"], 8, 4, "8 ranks but this host has 4 GPU(s)"),
    (["--sp", "4"], 6, None, "--sp 4 does not divide the 6 ranks (ranks = data x sequence); sizes that fit: "
                             "[1, 2, 3, 6]"),
    (["--sp", "2", "--seq", "4096,4097"], 2, 2, "--sp 2 does not divide --seq 4097"),
    (["--sp", "3", "--seq", "3072"], 3, 3, "--sp 3 does not divide the model's 16 attention heads (--size 220m)"),
])
def test_layouts_that_cannot_run_are_refused(argv, world, gpus, words):
    args = autosp_gpu.parse_args(argv)
    with pytest.raises(SystemExit) as exc:
        autosp_gpu.check_layout(args, world, gpus, autosp_gpu.heads_of(args))
    assert words in str(exc.value)


def test_a_layout_that_fits_passes_and_smoke_defaults_yield_to_flags():
    args = autosp_gpu.parse_args(["--sp", "1,2,4,8", "--seq", "8192,4096"])
    autosp_gpu.check_layout(args, 8, 8, autosp_gpu.heads_of(args))
    assert args.seq_list == [4096, 8192]
    smoke = autosp_gpu.parse_args(["--smoke", "--seq", "16"])
    assert (smoke.size, smoke.sp_list, smoke.seq_list, smoke.dtype) == ("smoke", [1, 2], [16], "fp32")


def test_zero_gpu_sp1_rows_follow_each_polyaccel_row(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["zero_gpu.py", "--sp1", "--peers", "", "--only", "=stage 1,=stage 3",
                                      "--no-granular"])
    captured = {}

    def fake_isolated(args, peers):
        captured["names"] = zero_gpu.row_names(args, peers)
        return 0

    monkeypatch.setattr(zero_gpu, "run_isolated", fake_isolated)
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--isolate"])
    assert zero_gpu.main() == 0
    assert captured["names"][1:] == ["polyaccel stage 1", "polyaccel stage 1 sp1", "polyaccel stage 3",
                                     "polyaccel stage 3 sp1"]
