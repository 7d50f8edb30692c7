"""benchmarks/conformance_compiles.py: the Triton compiles of the cuda conformance run, counted on the CPU
with Triton's own specialization (a size that is a multiple of 16, equal to 1, or neither; constexprs;
options)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import conformance_compiles  # noqa: E402


def test_a_launch_key_is_what_triton_specializes_on():
    from polyaccel.testing.conformance import triton_probe

    fn = triton_probe._add_kernel.fn
    counter = conformance_compiles.CompileCounter()

    def launch(n, dtype=torch.float32, offset=0, **options):
        x = torch.zeros(n + offset, dtype=dtype)[offset:]
        counter.record(fn, (x, x, x, n), {"BLOCK": 256, "grid": (1,), "warmup": False, **options})
        return len(counter.first_row)

    assert launch(17) == 1
    assert launch(23) == 1, "both sizes neither a multiple of 16 nor 1: one compile"
    assert launch(32) == 2, "a multiple of 16 is a new specialization"
    assert launch(48) == 2
    assert launch(1) == 3, "a size of 1 is a constant"
    assert launch(17, torch.bfloat16) == 4, "another dtype"
    assert launch(17, offset=1) == 5, "a pointer not 16-byte aligned"
    assert launch(17, num_warps=4) == 5, "the default options spelled out are the same compile"
    assert launch(17, num_warps=8) == 6


def test_counts_of_two_ops_in_a_fresh_process(tmp_path):
    out = tmp_path / "counts.json"
    script = str(BENCHMARKS / "conformance_compiles.py")
    proc = subprocess.run([sys.executable, script, "--ops", "swiglu,grouped_mm", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = json.loads(out.read_text())
    assert counts["failed"] == []
    # swiglu: one forward and one backward kernel per dtype (its shapes share one key); grouped_mm: the Triton
    # builder's ragged and aligned-K cases in fp32, bf16 and fp16 (float64 takes the reference)
    assert counts["per_op"] == {"grouped_mm": 6, "swiglu": 8}, counts["per_op"]
    assert counts["total"] == 14
    assert "total distinct compiles: 14" in proc.stdout
