"""The cuda plugin's Triton muon_momentum and muon_apply under the interpreter: the ops' conformance checks on CPU
tensors (every dtype; float64 through the reference), the vector path for aligned pieces, one launch per call,
and a planted defect the conformance check catches."""

from __future__ import annotations

import pytest
import torch
from polyaccel.ops.reference import muon_passes as ref
from polyaccel.plugins.cuda.kernels import muon_passes as kn
from polyaccel.testing.conformance import opcases_muon_passes as cases

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conformance_on_cpu_tensors(dtype):
    cases.check_muon_momentum(kn.muon_momentum, CPU, dtype)
    cases.check_muon_apply(kn.muon_apply, CPU, dtype)


def test_aligned_pieces_take_the_vector_path_and_match_the_reference():
    torch.manual_seed(0)
    lengths = [64, 200, 16, 0, 130]
    offsets = [0, 64, 272, 288, 304]  # every offset a multiple of 16
    assert kn.piece_table((offsets, offsets, offsets), lengths, 64, CPU).aligned
    for nesterov in (True, False):
        g = torch.randn(448).to(torch.bfloat16)
        b = torch.randn(448) * 0.1
        o = torch.randn(448).to(torch.float32)
        b2, o2 = b.double(), o.double()
        kw = dict(grad_offsets=offsets, buffer_offsets=offsets, out_offsets=offsets, lengths=lengths, momentum=0.95,
                  nesterov=nesterov)
        kn.muon_momentum(g, b, o, **kw)
        ref.muon_momentum(g.double(), b2, o2, **kw)
        torch.testing.assert_close(b.double(), b2, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(o.double(), o2, rtol=1e-6, atol=1e-7)


def test_one_launch_per_call_and_the_table_is_kept(count_launches):
    launches = count_launches(kn, "_momentum_kernel")
    kn.clear_cache()
    lengths = [37, 100, 5, 64]
    offsets = [0, 40, 150, 160]
    for _ in range(2):
        g, b, o = torch.randn(230), torch.randn(230), torch.empty(230, dtype=torch.bfloat16)
        kn.muon_momentum(g, b, o, grad_offsets=offsets, buffer_offsets=offsets, out_offsets=offsets,
                         lengths=lengths, momentum=0.9, nesterov=True)
    assert len(launches) == 2 and len(kn._tables) == 1  # the second call reused the table (other buffers)


def test_a_planted_defect_fails_the_conformance_check():
    def momentum_halved(grad, momentum_buffer, out, **kw):
        """The bug: the momentum's weight is not the one asked for."""
        kw["momentum"] = kw["momentum"] * 0.5
        ref.muon_momentum(grad, momentum_buffer, out, **kw)

    with pytest.raises(AssertionError, match="muon_momentum"):
        cases.check_muon_momentum(momentum_halved, CPU, torch.float32)

    def apply_without_decay(params, updates, **kw):
        kw["weight_decays"] = [0.0] * len(kw["weight_decays"])
        ref.muon_apply(params, updates, **kw)

    with pytest.raises(AssertionError, match="muon_apply"):
        cases.check_muon_apply(apply_without_decay, CPU, torch.float32)


def test_tables_reach_a_device_through_pinned_memory_without_waiting(monkeypatch):
    """A learning-rate schedule makes muon_apply's factor table new at every step: its upload must be queued
    (pinned, non-blocking), never a pageable copy that first waits for the device's queued work."""
    from polyaccel.plugins.cuda.kernels import chunk_table

    calls = []

    class Host:
        def pin_memory(self):
            calls.append("pin_memory")
            return self

        def to(self, device, non_blocking=False):
            calls.append(("to", str(device), non_blocking))
            return "on device"

    staged = Host()
    assert chunk_table.upload(staged, torch.device("cuda", 0)) == "on device"
    assert calls == ["pin_memory", ("to", "cuda:0", True)]
    host = torch.arange(4.0)
    assert chunk_table.upload(host, CPU) is host  # (the interpreter's CPU tensors: no copy at all)
    uploaded = []
    monkeypatch.setattr(kn, "upload", lambda t, device: uploaded.append(device) or chunk_table.upload(t, device))
    kn.clear_cache()
    kn._factor_table(0.01, [0.1], [1.0], CPU)
    kn.piece_table(([0], [0]), [5], 4, CPU)
    assert uploaded == [CPU, CPU]  # both tables go through it
