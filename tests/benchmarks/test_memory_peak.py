"""benchmarks/memory_peak.py: replaying an allocator trace to find what is live at its peak."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import memory_peak  # noqa: E402


def _frames(name, line):
    return [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": f"/work/engines/zero/{name}.py", "line": line, "name": "f"}]


def _trace():
    return [
        {"action": "free_completed", "addr": 999, "size": 50},  # allocated before the trace: ignored
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames("stage3", 10)},
        {"action": "alloc", "addr": 2, "size": 300, "frames": _frames("stage3", 10)},
        {"action": "alloc", "addr": 3, "size": 200, "frames": _frames("partition", 5)},
        {"action": "free_requested", "addr": 2, "size": 300},  # still counted until completed
        {"action": "alloc", "addr": 4, "size": 50, "frames": []},  # 650 so far
        {"action": "free_completed", "addr": 2, "size": 300},
        {"action": "alloc", "addr": 5, "size": 400, "frames": _frames("stage3", 99)},  # 750: the new peak
        {"action": "free_completed", "addr": 5, "size": 400},
    ]


def test_replay_counts_a_block_until_its_free_completes():
    peak, live = memory_peak.replay(_trace())
    assert peak == 750
    assert sorted(live) == [1, 3, 4, 5]


def test_free_requested_is_used_when_the_trace_has_no_completions():
    trace = [e for e in _trace() if e["action"] != "free_completed"]
    peak, live = memory_peak.replay(trace)
    assert peak == 750 and sorted(live) == [1, 3, 4, 5]  # addr 2 freed at its request


def test_report_groups_live_blocks_by_the_innermost_frame_of_our_code():
    report = memory_peak.peak_report({"device_traces": [_trace()]}, top=10)
    lines = report.splitlines()
    assert "0.000 GiB in 4 blocks" in lines[0]
    sites = [line.split("blocks", 1)[1].strip() for line in lines[1:]]
    assert sites == ["stage3.py:99 f", "partition.py:5 f", "stage3.py:10 f", "(no frames recorded)"]
    assert memory_peak.peak_report({"device_traces": []}).startswith("no trace for device 0")
