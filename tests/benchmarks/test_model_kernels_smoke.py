"""benchmarks/model_kernels_gpu.py --smoke: every section runs on the CPU and reports each implementation."""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import model_kernels_gpu  # noqa: E402


def test_smoke_runs_every_section_and_writes_json(tmp_path):
    out = tmp_path / "r.json"
    results = model_kernels_gpu.main(["--smoke", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert {r["section"] for r in doc["results"]} == set(model_kernels_gpu.SECTIONS)
    assert doc["builders"]["rms_norm"] == "cpu_rms_norm" and doc["builders"]["rope"] == "cpu_rope"
    for r in results:
        if r.impl in ("hf_eager", "polyaccel"):
            assert r.fwd_ms > 0 and r.fwd_bwd_ms > 0 and not r.note, r
            assert r.max_rel_diff < 2e-2, r  # bf16: polyaccel agrees with Hugging Face's module
        else:
            assert r.note, r  # torch.compile skipped under --smoke; Liger absent or CPU
