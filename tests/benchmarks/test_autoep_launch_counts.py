"""benchmarks/autoep_launches.py: AutoEP's layer on the cuda plugin's expert builders launches far fewer kernels a
step than transformers' grouped_mm block (what a host-bound step costs), counted on the CPU."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import autoep_launches  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


def test_autoep_launches_under_three_quarters_of_hf_grouped_mm(monkeypatch):
    import importlib

    import polyaccel
    from autoep_gpu import autoep_block, hf_block

    polyaccel.register_plugin("cuda_kernels_on_cpu", autoep_launches.CudaKernelsOnCpu())
    device = torch.device("cpu")
    # (on a GPU the offsets' host check waits for the device: AutoEP's end rows, valid by construction, skip it)
    reference_grouped_mm = importlib.import_module("polyaccel.ops.reference.grouped_mm")
    monkeypatch.setattr(reference_grouped_mm, "_checked_on_host", lambda off, rows: pytest.fail("offsets read back"))
    eager = hf_block(8, 2, 64, 32, "eager", device)
    x = torch.randn(1, 48, 64).to(torch.bfloat16)
    grad = torch.randn(1, 48, 64)
    ours = autoep_launches.count_step(autoep_block(eager), x, grad)
    monkeypatch.undo()
    hf = autoep_launches.count_step(hf_block(8, 2, 64, 32, "grouped_mm", device), x, grad)
    assert ours.ops["_grouped_mm"] == hf.ops["_grouped_mm"] == 6, "the same six expert GEMMs"
    assert sum(ours.triton.values()) <= 6
    # (55 aten + 5 Triton before the short route, the sorted-id search and one node per expert op: 60 of 64;
    # 39 + 6 with the offsets read back to check them)
    assert ours.total + sum(ours.triton.values()) <= 3 / 4 * hf.total, (ours.ops, ours.triton, hf.ops)
    assert "sort" in ours.ops and "scatter_add_" not in ours.ops and "cumsum" not in ours.ops
