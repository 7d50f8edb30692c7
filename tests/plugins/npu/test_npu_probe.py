"""npu probe and selection: through the (emulated) runtime, including the missing-CANN case."""

from __future__ import annotations

import sys

import polyaccel
import pytest
import torch
from polyaccel import SelectionError, selection
from polyaccel.report import build_report
from polyaccel.testing.emulation import emulate


def _record(name):
    return selection.plugins().records[name]


def test_without_emulation_npu_is_unavailable_with_a_reason():
    assert "torch_npu" not in sys.modules and not hasattr(torch, "npu")
    rec = _record("npu")
    assert rec.status == "unavailable"
    assert "torch_npu is not installed" in rec.reason
    assert polyaccel.get_accelerator().name != "npu"
    report = build_report()
    row = next(p for p in report["plugins"] if p["name"] == "npu")
    assert row["status"] == "unavailable" and "torch_npu is not installed" in row["reason"]
    assert row["emulated"] is False


def test_emulated_npu_is_probed_and_selected():
    with emulate("npu", device_count=2) as rt:
        acc = polyaccel.get_accelerator()
        assert acc.name == "npu" and acc.device_type == "npu"
        probe = acc.probe()
        assert probe.available and probe.device_count == 2 and probe.emulated
        assert acc.is_emulated()
        assert rt.calls.count_of("is_available") >= 1, "the probe must ask the runtime"
        rec = _record("npu")
        assert rec.status == "selected" and rec.emulated
        report = build_report()
        assert report["selected"]["name"] == "npu"
        assert next(p for p in report["plugins"] if p["name"] == "npu")["emulated"] is True
        assert report["extra"]["npu"]["emulated"] is True
    assert not hasattr(torch, "npu") and "torch_npu" not in sys.modules
    assert polyaccel.get_accelerator().name != "npu"


def test_missing_cann_libraries_make_npu_unavailable_with_the_autoload_hint():
    with emulate("npu", library_missing=True):
        with pytest.raises(ImportError, match="libhccl.so"):
            import torch_npu  # noqa: F401
        rec = _record("npu")
        assert rec.status == "unavailable"
        assert "libhccl.so" in rec.reason and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in rec.reason
        assert polyaccel.get_accelerator().name != "npu"
        extra = build_report()["extra"]["npu"]
        assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in extra["hint"]


def test_installed_runtime_without_a_device_is_unavailable():
    with emulate("npu", no_device=True):
        rec = _record("npu")
        assert rec.status == "unavailable" and "is_available() is False" in rec.reason
        assert rec.emulated


def test_asking_for_npu_by_name_when_absent_lists_the_reason(monkeypatch):
    monkeypatch.setenv("POLYACCEL_ACCELERATOR", "npu")
    with pytest.raises(SelectionError, match="torch_npu is not installed"):
        polyaccel.get_accelerator()


def test_comm_hooks_name_hccl_with_device_binding():
    from polyaccel.comm import resolve_hooks

    with emulate("npu"):
        acc = polyaccel.get_accelerator()
        hooks = resolve_hooks(acc)
        assert hooks.backend == "hccl" and hooks.pass_device_id and hooks.supports_device_tensors
        assert acc.communication_backend == "hccl"


def test_capabilities_follow_the_runtime():
    with emulate("npu"):
        caps = polyaccel.get_accelerator().capabilities()
        assert {"graphs", "host_register", "streams", "events", "rng", "memory_stats", "pinned", "bf16",
                "fp16"} <= caps
        assert not {"fp64", "fp8", "triton", "async_p2p"} & caps
    with emulate("npu", no_graphs=True, no_npurt=True):
        caps = polyaccel.get_accelerator().capabilities()
        assert "graphs" not in caps and "host_register" not in caps


def test_device_rng_is_reproducible():
    with emulate("npu") as rt:
        acc = polyaccel.get_accelerator()
        acc.manual_seed(1234)
        a = torch.randn(16, device=acc.device())
        state = acc.get_rng_state()
        b = torch.randn(16, device=acc.device())
        acc.manual_seed(1234)
        assert torch.equal(torch.randn(16, device=acc.device()), a)
        acc.set_rng_state(state)
        assert torch.equal(torch.randn(16, device=acc.device()), b)
        assert rt.calls.count_of("manual_seed") == 2


def test_set_device_is_checked_by_the_runtime():
    with emulate("npu", device_count=2) as rt:
        acc = polyaccel.get_accelerator()
        acc.set_device(1)
        assert acc.current_device() == 1 and rt.calls.last("set_device").args == (1,)
        with pytest.raises(RuntimeError, match="Invalid device id"):
            acc.set_device(2)


_IMPORT_SPY = """
import importlib.abc, sys
seen = []
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch_npu', 'torch_supa', 'torch_supa_ext'):
            seen.append(name)
        return None
sys.meta_path.insert(0, Spy())
import polyaccel
import polyaccel.plugins.npu, polyaccel.plugins.npu.accelerator, polyaccel.plugins.npu.ops
import polyaccel.plugins.supa, polyaccel.plugins.supa.accelerator, polyaccel.plugins.supa.ops
polyaccel.plugins.npu.polyaccel_accelerators(); polyaccel.plugins.supa.polyaccel_accelerators()
print('IMPORT-TIME', seen)
from polyaccel import selection
selection.plugins()
print('PROBE-TIME', sorted(set(seen)))
"""


def test_vendor_runtimes_are_looked_up_only_when_probing():
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _IMPORT_SPY], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORT-TIME []" in proc.stdout, proc.stdout
    assert "PROBE-TIME ['torch_npu', 'torch_supa']" in proc.stdout, proc.stdout


def test_memory_stats_and_pinning_go_through_the_runtime():
    with emulate("npu") as rt:
        acc = polyaccel.get_accelerator()
        base = acc.memory_allocated()
        block = torch.empty(1 << 18, dtype=torch.float32, device=acc.device())
        assert acc.memory_allocated() >= base + block.numel() * 4
        assert acc.max_memory_allocated() >= acc.memory_allocated()
        del block
        assert acc.memory_allocated() <= base + 4096
        host = torch.randn(1000)
        pinned = acc.pin_memory(host)
        assert pinned is not host and torch.equal(pinned, host) and acc.is_pinned(pinned)
        assert not acc.is_pinned(host) and acc.pin_memory(pinned) is pinned
        assert rt.calls.count_of("pin_memory") == 1
