"""rocm plugin on a CPU-only machine: an emulated ``torch.version.hip`` and emulated AMD device
properties (MI300X, MI355X, RDNA3, MI100) drive detection, selection, fp8 formats, wavefront
size, Triton gating, RCCL comm hooks and host-registration error clearing."""

from __future__ import annotations

import types

import polyaccel
import pytest
import torch
from polyaccel import ops, selection
from polyaccel.errors import PolyaccelError
from polyaccel.plugins import rocm as rocm_plugin
from polyaccel.plugins.cuda import accelerator as cuda_acc
from polyaccel.plugins.rocm.accelerator import RocmAccelerator

ARCHS = {
    "mi300x": ("AMD Instinct MI300X", "gfx942:sramecc+:xnack-", (9, 4), 64),
    "mi355x": ("AMD Instinct MI355X", "gfx950:sramecc+:xnack-", (9, 5), 64),
    "rx7900": ("Radeon RX 7900 XTX", "gfx1100", (11, 0), 32),
    "mi100": ("AMD Instinct MI100", "gfx908:sramecc+:xnack-", (9, 0), 64),
}


def fake_rocm(monkeypatch, arch="mi300x", count=8, hip="6.2.41133"):
    name, gcn, cap, warp = ARCHS[arch]
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    props = types.SimpleNamespace(name=name, gcnArchName=gcn, major=cap[0], minor=cap[1], total_memory=192 << 30,
                                  warp_size=warp, multi_processor_count=304)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    selection.reset()


def test_not_a_rocm_build():
    if torch.version.hip:
        pytest.skip("this torch is a ROCm build")
    res = RocmAccelerator().probe()
    assert not res.available and "not a ROCm build" in res.reason


def test_hip_build_selects_rocm_and_never_cuda(monkeypatch):
    fake_rocm(monkeypatch)
    monkeypatch.setenv("POLYACCEL_PLUGINS", "cpu,cuda,rocm")
    acc = polyaccel.get_accelerator()
    assert acc.name == "rocm" and acc.device_type == "cuda"
    recs = {r.name: r for r in selection.plugins().records.values()}
    assert recs["cuda"].status == "unavailable" and "rocm plugin" in recs["cuda"].reason
    res = acc.probe()
    assert res.available and res.device_count == 8 and res.details["torch_hip"] == "6.2.41133"
    assert "torch_cuda" not in res.details


def test_hip_build_without_gpu(monkeypatch):
    fake_rocm(monkeypatch, count=0)
    res = RocmAccelerator().probe()
    assert not res.available and "AMD GPU" in res.reason


@pytest.mark.parametrize("arch,fp8,bf16,warp", [
    ("mi300x", ("float8_e4m3fnuz", "float8_e5m2fnuz"), True, 64),
    ("mi355x", ("float8_e4m3fn", "float8_e5m2"), True, 64),
    ("rx7900", (), True, 32),
    ("mi100", (), False, 64),
])
def test_fp8_formats_bf16_and_wavefront_per_architecture(monkeypatch, arch, fp8, bf16, warp):
    fake_rocm(monkeypatch, arch=arch)
    acc = RocmAccelerator()
    assert tuple(str(d).replace("torch.", "") for d in acc.fp8_dtypes()) == fp8
    caps = acc.capabilities()
    assert ("fp8" in caps) is bool(fp8) and ("bf16" in caps) is bf16
    assert {"graphs", "host_register", "streams", "events", "pinned"} <= caps
    assert acc.warp_size() == warp
    assert acc.gcn_arch() == ARCHS[arch][1].split(":")[0]


def test_wavefront_from_arch_when_props_lack_it(monkeypatch):
    fake_rocm(monkeypatch, arch="rx7900")
    props = torch.cuda.get_device_properties(0)
    del props.warp_size
    assert RocmAccelerator().warp_size() == 32


def test_triton_needs_the_amd_backend_and_a_supported_arch(monkeypatch):
    import triton.backends

    fake_rocm(monkeypatch, arch="mi300x")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(triton.backends, "backends", {"nvidia": object()})
    acc = RocmAccelerator()
    ok, why = acc.triton_device_support()
    assert not ok and "no AMD backend" in why
    assert "triton" not in acc.capabilities()
    monkeypatch.setattr(triton.backends, "backends", {"amd": object()})
    assert RocmAccelerator().triton_device_support() == (True, "")
    assert "triton" in RocmAccelerator().capabilities()
    fake_rocm(monkeypatch, arch="mi100")
    ok, why = RocmAccelerator().triton_device_support()
    assert not ok and "gfx908" in why
    # the cuda plugin's Triton builders serve the rocm accelerator through the same check
    fake_rocm(monkeypatch, arch="mi300x")
    monkeypatch.setenv("POLYACCEL_PLUGINS", "cpu,cuda,rocm")
    assert ops.registry.chosen("fused_adam", "cuda").name == "triton_fused_adam"


def test_comm_hooks_use_rccl_under_the_nccl_backend_name(monkeypatch):
    fake_rocm(monkeypatch)
    acc = RocmAccelerator()
    hooks = acc.comm_hooks()
    assert hooks.backend == "nccl" and hooks.pass_device_id
    # rocm's answers are its accelerator's own: the plugin has no broadcast hook a cuda accelerator passes through
    assert not hasattr(rocm_plugin, "polyaccel_comm_hooks") and not hasattr(rocm_plugin, "polyaccel_report")
    rep = acc.report_facts()
    assert rep["collective_library"] == "rccl" and rep["wavefront_size"] == 64
    assert rep["fp8_dtypes"] == ["float8_e4m3fnuz", "float8_e5m2fnuz"]
    assert rep["devices"][0]["arch"].startswith("gfx942")


def test_refused_hip_registration_clears_hips_last_error(monkeypatch):
    fake_rocm(monkeypatch)
    asked = []
    state = {"err": 0}

    class FakeHipRt:
        def cudaHostRegister(self, ptr, n, flags):  # noqa: N802 - torch keeps CUDA names on ROCm
            state["err"] = 712
            return 712

        def cudaGetErrorString(self, rc):  # noqa: N802
            return "hipErrorHostMemoryAlreadyRegistered"

    monkeypatch.setattr(RocmAccelerator, "_cudart", lambda self: FakeHipRt())

    def lookup(lib, sym):
        asked.append((lib, sym))
        return lambda: state.update(err=0)

    monkeypatch.setattr(cuda_acc, "runtime_function", lookup)
    with pytest.raises(PolyaccelError, match="hipErrorHostMemoryAlreadyRegistered"):
        RocmAccelerator().register_host_memory(torch.randn(16))
    assert asked == [("libamdhip64", "hipGetLastError")] and state["err"] == 0
