"""`polyaccel report` for people: one line per op within 100 columns, no word cut (the xpu install fix keeps
its URL), the builders for other devices counted instead of listed, and `--verbose` saying why."""

from __future__ import annotations

import json
import re

import pytest
from polyaccel.cli import main
from polyaccel.cli.report_text import wrap


def _report(capsys, monkeypatch, columns: int, *args: str) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["report", *args]) == 0
    return capsys.readouterr().out


@pytest.fixture
def rep(capsys):
    assert main(["report", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_one_line_per_op_within_100_columns(capsys, monkeypatch, rep):
    out = _report(capsys, monkeypatch, 100)
    lines = out.splitlines()
    assert max(map(len, lines)) <= 100
    assert len(lines) <= len(rep["ops"]) + 2 * len(rep["plugins"]) + 16, out  # 307 lines at 80 columns before
    assert "does not serve device type" not in out and "outranked" not in out  # the why is --verbose's
    device = rep["selected"]["device_type"]
    for op, info in rep["ops"].items():
        (row,) = [line for line in lines if line.startswith(f"  {op} ")]
        chosen = next(c for c in info["candidates"] if c["chosen"])
        others = [c for c in info["candidates"] if not c["chosen"]]
        here = [c for c in others if device in c["device_types"] or "*" in c["device_types"]]
        assert row.split()[1:4] == [chosen["builder"], chosen["plugin"], chosen["kind"]], row
        if len(others) > len(here):
            assert row.endswith(f"+{len(others) - len(here)} elsewhere"), row
        if here:
            assert f"+{len(here)} {device}" in row, row


def test_no_word_is_cut_and_the_xpu_fix_keeps_its_url(capsys, monkeypatch, rep):
    xpu = next(p for p in rep["plugins"] if p["name"] == "xpu")
    for columns in (100, 80):
        out = _report(capsys, monkeypatch, columns)
        assert max(map(len, out.splitlines())) <= columns
        url = re.search(r"https://\S+", xpu["reason"]).group(0)
        assert any(url in line.split() or url + ")" in line.split() for line in out.splitlines()), out
        words = " ".join(out.split())
        assert " ".join(xpu["reason"].split()) in words  # the whole reason, wrapped between words only
        assert "…" not in out


def test_verbose_says_why_each_builder_was_chosen_or_not(capsys, monkeypatch, rep):
    out = _report(capsys, monkeypatch, 100, "--verbose")
    assert max(map(len, out.splitlines())) <= 100
    text = " ".join(out.split())
    adam = rep["ops"]["fused_adam"]["candidates"]
    chosen = next(c for c in adam if c["chosen"])
    assert f"chosen: {chosen['reason']}" in text
    for c in adam:
        if c["chosen"]:
            continue
        if "cpu" in c["device_types"] or "*" in c["device_types"]:
            assert f"{c['builder']} ({c['plugin']}): {c['reason']}" in text
        else:
            assert f"{c['builder']} ({', '.join(c['device_types'])})" in text  # listed once, with its devices
    assert "does not serve device type" not in text


def test_wrap_breaks_between_words_and_puts_a_long_word_on_its_own_line():
    text = "install torch's XPU wheels (pip install torch --index-url https://download.pytorch.org/whl/xpu)"
    lines = wrap("  xpu  unavailable  ", text, 50)
    assert max(map(len, lines)) <= 50 and lines[0] == "  xpu  unavailable"
    assert " ".join(" ".join(lines).split()[2:]) == text
    assert any(line.strip().startswith("https://download.pytorch.org/whl/xpu)") for line in lines), lines
    lines = wrap("name: ", "short words only here", 14)
    assert lines == ["name: short", "      words", "      only", "      here"]
    error = "no plugin named 'x'.\nPlugins found:\n  - cpu: available\n  - xpu: unavailable: torch is built " \
            "without it"
    assert wrap("no accelerator selected: ", error, 40) == [
        "no accelerator selected: no plugin named",
        "                         'x'.",
        "    Plugins found:",
        "      - cpu: available",
        "      - xpu: unavailable: torch is built",
        "        without it"]


def test_without_an_accelerator_the_reasons_keep_their_lines(capsys, monkeypatch):
    monkeypatch.setenv("POLYACCEL_ACCELERATOR", "no-such-plugin")
    monkeypatch.setenv("COLUMNS", "100")
    from polyaccel import selection

    selection.reset()
    try:
        assert main(["report"]) == 1
    finally:
        monkeypatch.delenv("POLYACCEL_ACCELERATOR")
        selection.reset()
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100
    assert "no accelerator selected: POLYACCEL_ACCELERATOR=no-such-plugin" in out
    assert "\n      - cpu: " in out and "ops on" not in out  # one plugin a line, as the error lists them
