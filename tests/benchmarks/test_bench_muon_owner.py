"""benchmarks/bench_muon_owner.py --smoke on the CPU: the previous owner's path and the in-place batches give the
same bf16 results on tiny shapes of both models (whole and per head), one op call per batch of the plan."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_muon_owner  # noqa: E402


@pytest.mark.parametrize("per_head", [False, True], ids=["whole", "per head"])
def test_smoke_rows_report_equal_results(per_head):
    rows = bench_muon_owner.main(["--smoke", *(["--per-head"] if per_head else [])])
    owner = [r for r in rows if "owner's part" in r.case]
    assert len(owner) == 2 and len(rows) == 4, [r.detail for r in rows]
    for r in owner:
        assert "bit for bit True" in r.detail, r.detail
        assert f"op calls 2 -> {4 if per_head else 3}" in r.detail, r.detail
