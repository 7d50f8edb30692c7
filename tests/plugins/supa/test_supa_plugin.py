"""supa: detected before anything CUDA-like, bccl, supaHostRegister, SUPAGraph, under emulation."""

from __future__ import annotations

import sys

import polyaccel
import pytest
import torch
from polyaccel import PolyaccelError, Unsupported, selection
from polyaccel.host_registration import LEAKED_HOST_BUFFERS as _LEAKED_HOST_BUFFERS
from polyaccel.plugins.supa import emulation as emulated_supa
from polyaccel.report import build_report
from polyaccel.testing.emulation import emulate


def _record(name):
    return selection.plugins().records[name]


def test_without_emulation_supa_is_unavailable_with_a_reason():
    assert "torch_supa" not in sys.modules and not hasattr(torch, "supa")
    rec = _record("supa")
    assert rec.status == "unavailable" and "torch_supa is not installed" in rec.reason
    row = next(p for p in build_report()["plugins"] if p["name"] == "supa")
    assert row["status"] == "unavailable" and "torch_supa is not installed" in row["reason"]
    assert polyaccel.get_accelerator().name != "supa"


def test_supa_is_selected_although_torch_cuda_claims_to_be_available():
    with emulate("supa", device_count=2) as rt:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2, "the stand-in poses as torch.cuda"
        acc = polyaccel.get_accelerator()
        assert acc.name == "supa" and acc.is_emulated()
        probe = acc.probe()
        assert probe.available and probe.device_count == 2 and probe.emulated
        cuda = _record("cuda")
        assert cuda.status == "unavailable" and "torch_supa" in cuda.reason
        assert rt.calls.count_of("is_available") >= 1
        report = build_report()
        assert report["selected"]["name"] == "supa"
        assert report["extra"]["supa"]["emulated"] is True
    assert not torch.cuda.is_available() and not hasattr(torch, "supa")


def test_cuda_refuses_a_supa_machine_even_when_torch_reports_a_cuda_build(monkeypatch):
    """The order of checks matters: a CUDA-looking torch with torch_supa loaded is still SUPA."""
    with emulate("supa"):
        monkeypatch.setattr(torch.version, "cuda", "12.4")
        selection.reset()
        cuda = _record("cuda")
        assert cuda.status == "unavailable" and "supa plugin serves it" in cuda.reason
        assert polyaccel.get_accelerator().name == "supa"


def test_missing_runtime_libraries_make_supa_unavailable():
    with emulate("supa", library_missing=True):
        rec = _record("supa")
        assert rec.status == "unavailable" and "libsupa.so" in rec.reason
        assert polyaccel.get_accelerator().name not in ("supa", "cuda")


def test_no_visible_device():
    with emulate("supa", no_device=True):
        rec = _record("supa")
        assert rec.status == "unavailable" and "is_available() is False" in rec.reason
        assert _record("cuda").status == "unavailable"


def test_comm_backend_is_bccl():
    from polyaccel.comm import resolve_hooks

    with emulate("supa"):
        acc = polyaccel.get_accelerator()
        assert acc.communication_backend == "bccl" and resolve_hooks(acc).backend == "bccl"


def test_host_registration_through_supart_is_refcounted():
    with emulate("supa") as rt:
        acc = polyaccel.get_accelerator()
        t = torch.randn(1000)[3:]
        acc.register_host_memory(t)
        acc.register_host_memory(t)
        call = rt.calls.last("supaHostRegister")
        ptr, nbytes, flags = call.args
        assert rt.calls.count_of("supaHostRegister") == 1 and call.result == 0 and flags == 0
        assert ptr == t.data_ptr() and nbytes >= t.numel() * t.element_size()
        assert acc.unregister_host_memory(t) is False and rt.supart.registered
        assert acc.unregister_host_memory(t) is True and rt.supart.registered == {}


def test_refused_registration_names_the_runtime_error():
    with emulate("supa", registration_refused=True):
        acc = polyaccel.get_accelerator()
        with pytest.raises(PolyaccelError, match="supaHostRegister.*invalid argument"):
            acc.register_host_memory(torch.randn(64))
        assert acc.host_registrations() == {}


def test_failed_unregister_keeps_the_memory_alive():
    with emulate("supa") as rt:
        acc = polyaccel.get_accelerator()
        t = torch.randn(512)
        ptr = t.data_ptr()
        acc.register_host_memory(t)
        rt.faults.unregister_fails = True
        n = len(_LEAKED_HOST_BUFFERS)
        with pytest.raises(PolyaccelError, match="kept alive"):
            acc.unregister_host_memory(t)
        assert rt.calls.last("supaHostUnregister").result == emulated_supa.SUPA_ERROR_HOST_MEMORY_NOT_REGISTERED
        assert len(_LEAKED_HOST_BUFFERS) == n + 1 and _LEAKED_HOST_BUFFERS[-1].tensor.data_ptr() == ptr


def test_without_supart_registration_is_unsupported():
    with emulate("supa", no_supart=True):
        acc = polyaccel.get_accelerator()
        assert "host_register" not in acc.capabilities()
        with pytest.raises(Unsupported, match="supa"):
            acc.register_host_memory(torch.randn(8))


def test_graph_ops_route_to_supagraph_and_replay_recomputes():
    with emulate("supa") as rt:
        acc = polyaccel.get_accelerator()
        x, w = torch.randn(64), torch.randn(64)
        graph = acc.create_graph()
        with acc.capture_to_graph(graph):
            y = torch.sigmoid(x) * w
        for _ in range(2):
            fresh = torch.randn(64)
            x.copy_(fresh)
            acc.replay_graph(graph)
            torch.testing.assert_close(y.double(), torch.sigmoid(fresh.double()) * w.double(), rtol=1e-6, atol=1e-6)
        assert rt.calls.count_of("SUPAGraph.replay") == 2 and rt.calls.count_of("graph") == 1


def test_without_supagraph_graph_ops_are_unsupported():
    with emulate("supa", no_graphs=True):
        acc = polyaccel.get_accelerator()
        with pytest.raises(Unsupported, match="supa"):
            acc.create_graph()
        with pytest.raises(Unsupported, match="supa"):
            acc.replay_graph(None)
