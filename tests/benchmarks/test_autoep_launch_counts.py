"""benchmarks/autoep_launches.py: AutoEP's layer on the cuda plugin's expert builders launches far fewer kernels a
step than transformers' grouped_mm block (what a host-bound step costs) and reads nothing back to the host,
counted on the CPU."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import autoep_launches  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


def test_autoep_launches_about_half_of_hf_grouped_mm_and_reads_nothing_back(monkeypatch):
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
    unfused = autoep_launches.count_step(autoep_block(eager, fused=False), x, grad)
    monkeypatch.undo()
    hf = autoep_launches.count_step(hf_block(8, 2, 64, 32, "grouped_mm", device), x, grad)
    # no value read back to the host in a forward + backward at fixed shapes, on either AutoEP path (on a GPU
    # each read waits for the device); HF's eager loop reads which experts were hit
    assert not ours.syncs and not unfused.syncs, (ours.syncs, unfused.syncs)
    assert sum(autoep_launches.count_step(eager, x, grad).syncs.values()) >= 8
    assert ours.ops["_grouped_mm"] == hf.ops["_grouped_mm"] == 6, "the same six expert GEMMs"
    assert sum(ours.triton.values()) <= 6
    # (55 aten + 5 Triton before the short route, the sorted-id search and one node per expert op: 60 of 64;
    # 39 + 6 with the offsets read back to check them; 34 + 6 before the router's logits were computed
    # alone)
    assert ours.total + sum(ours.triton.values()) <= 33, (ours.ops, ours.triton, hf.ops)
    assert ours.total + sum(ours.triton.values()) <= 0.55 * hf.total
    assert "topk" in ours.ops and ours.ops["topk"] == 1, "one top-k: the layer's route, not the router's own too"
    assert "sort" in ours.ops and "scatter_add_" not in ours.ops and "cumsum" not in ours.ops
