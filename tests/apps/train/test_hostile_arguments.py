"""`polyaccel train` refuses hostile arguments with one line naming the flag, before any rank starts."""

from __future__ import annotations

import pytest
from polyaccel.apps.train import options
from polyaccel.cli import main


def _error(capsys, argv) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polyaccel train: error: ") and err.count("\n") == 1, err
    return err


def test_nproc_is_bounded_by_the_host_cores(no_spawn, capsys, monkeypatch):
    monkeypatch.setattr(options, "_cpu_count", lambda: 2)
    limit = options.max_cpu_ranks()
    assert limit == max(options.MIN_CPU_RANK_LIMIT, 2 * options.CPU_RANKS_PER_CORE)
    err = _error(capsys, ["--nproc", "100000"])
    assert f"--nproc 100000: at most {limit} ranks" in err and f"use --nproc {limit} or less" in err
    err = _error(capsys, ["--nproc", str(limit + 1), "--steps", "0"])  # the bound is checked, not a fluke
    assert "--steps 0" in err


def test_nproc_at_the_bound_passes_the_check(monkeypatch):
    import polyaccel
    from polyaccel.cli import build_parser

    monkeypatch.setattr(options, "_cpu_count", lambda: 64)
    args = build_parser().parse_args(["train", "--nproc", str(64 * options.CPU_RANKS_PER_CORE)])
    assert options._nproc(args.nproc, polyaccel.get_accelerator()) == 64 * options.CPU_RANKS_PER_CORE


@pytest.mark.parametrize("content, message", [
    ("", "the file is empty; pass a UTF-8 text of more than --seq-len bytes"),
    ("ab", "the text has only 2 tokens (a window needs --seq-len + 1 = 65); pass a longer --text file"),
    ("abcdef", "the text has only 6 tokens (a window needs --seq-len + 1 = 65); use --seq-len 5 or less"),
])
def test_empty_or_short_text(no_spawn, capsys, tmp_path, content, message):
    text = tmp_path / "t.txt"
    text.write_text(content)
    err = _error(capsys, ["--text", str(text)])
    assert message in err
    if not content:
        assert f"--text {text}" in err


def test_expert_degree_names_the_flag(no_spawn, capsys):
    err = _error(capsys, ["--nproc", "1", "--model", "mixtral", "--ep", "3"])
    assert "--ep 3 does not divide the 1 data-parallel ranks" in err
