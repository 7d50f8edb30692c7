"""cuda plugin logic on a CPU-only machine: probing, selection, capabilities, Triton gating,
host registration against a fake cudart, graph ops, comm hooks and op registration.

``torch.cuda`` is monkeypatched to look like a machine with NVIDIA GPUs; nothing here touches
a real GPU (the H200 run covers that: benchmarks/verify_cuda.py).
"""

from __future__ import annotations

import types

import polyaccel
import pytest
import torch
from polyaccel import accelerator as core_accelerator
from polyaccel import host_registration, ops, selection
from polyaccel.errors import PolyaccelError, Unsupported
from polyaccel.plugins import cuda as cuda_plugin
from polyaccel.plugins.cuda import accelerator as cuda_acc
from polyaccel.plugins.cuda import triton_support
from polyaccel.plugins.cuda.accelerator import CudaAccelerator


def fake_gpus(monkeypatch, count=2, capability=(9, 0), cuda="12.4", hip=None):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    props = types.SimpleNamespace(name="Fake H200", major=capability[0], minor=capability[1],
                                  total_memory=141 << 30, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    selection.reset()


class FakeCudart:
    """Records calls; returns the codes it is told to (0 = cudaSuccess)."""

    def __init__(self, register_rc=0, unregister_rc=0):
        self.register_rc, self.unregister_rc = register_rc, unregister_rc
        self.calls = []
        self.last_error = 0

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - the runtime's name
        self.calls.append(("register", ptr, nbytes, flags))
        self.last_error = self.register_rc or self.last_error
        return self.register_rc

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        self.last_error = self.unregister_rc or self.last_error
        return self.unregister_rc

    def cudaGetErrorString(self, rc):  # noqa: N802
        return {712: "part or all of the requested memory range is already mapped",
                713: "pointer does not correspond to a registered memory region"}.get(int(rc), "unknown")

    def get_last_error(self):
        rc, self.last_error = self.last_error, 0
        return rc


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    fake_gpus(monkeypatch)
    monkeypatch.setattr(CudaAccelerator, "_cudart", lambda self: fake)
    monkeypatch.setattr(cuda_acc, "runtime_function", lambda lib, sym: fake.get_last_error)
    return fake


# ------------------------------------------------------------------------------------ probe
def test_cpu_build_of_torch_is_unavailable_with_reason():
    if torch.version.cuda:
        pytest.skip("this torch has CUDA; the CPU-build reason cannot appear")
    res = CudaAccelerator().probe()
    assert not res.available and "without CUDA" in res.reason


def test_probe_with_gpus(monkeypatch):
    fake_gpus(monkeypatch, count=2)
    res = CudaAccelerator().probe()
    assert res.available and res.device_count == 2 and res.details["torch_cuda"] == "12.4"


def test_probe_no_gpu_or_broken_driver(monkeypatch):
    fake_gpus(monkeypatch, count=0)
    assert "is_available() is False" in CudaAccelerator().probe().reason

    def boom():
        raise RuntimeError("driver too old")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    res = CudaAccelerator().probe()
    assert not res.available and "driver too old" in res.reason


def test_rocm_and_supa_builds_are_left_to_their_plugins(monkeypatch):
    fake_gpus(monkeypatch, hip="6.2.41133")
    res = CudaAccelerator().probe()
    assert not res.available and "ROCm build" in res.reason and "rocm plugin" in res.reason
    fake_gpus(monkeypatch)
    monkeypatch.setattr(torch, "supa", types.SimpleNamespace(), raising=False)
    res = CudaAccelerator().probe()
    assert not res.available and "supa plugin" in res.reason


def test_selected_over_cpu_when_gpus_exist(monkeypatch):
    fake_gpus(monkeypatch)
    monkeypatch.setenv("POLYACCEL_PLUGINS", "cpu,cuda,rocm")
    acc = polyaccel.get_accelerator()
    assert acc.name == "cuda" and acc.communication_backend == "nccl"
    recs = {r.name: r for r in selection.plugins().records.values()}
    assert recs["rocm"].status != "available" and "not a ROCm build" in recs["rocm"].reason


# ----------------------------------------------------------------------------- capabilities
@pytest.mark.parametrize("cap,bf16,fp8", [((9, 0), True, True), ((8, 9), True, True), ((8, 0), True, False),
                                          ((7, 5), False, False)])
def test_capabilities_follow_the_device(monkeypatch, cap, bf16, fp8):
    fake_gpus(monkeypatch, capability=cap)
    acc = CudaAccelerator()
    caps = acc.capabilities()
    assert {"streams", "events", "graphs", "host_register", "pinned", "async_p2p", "memory_stats", "rng",
            "fp16", "fp64"} <= caps
    assert ("bf16" in caps) is bf16 and ("fp8" in caps) is fp8
    assert (torch.float8_e4m3fn in acc.fp8_dtypes()) is fp8
    assert "triton" not in caps  # TRITON_INTERPRET=1 here: the Triton builders are not used
    assert set(caps) <= set(core_accelerator.KNOWN_CAPABILITIES)


def test_unavailable_accelerator_claims_nothing_and_graphs_raise_unsupported():
    acc = CudaAccelerator()
    if acc.probe().available:
        pytest.skip("a real GPU is present")
    assert acc.capabilities() == frozenset()
    with pytest.raises(Unsupported, match="cuda"):
        acc.create_graph()
    with pytest.raises(Unsupported, match="cuda"):
        acc.register_host_memory(torch.randn(4))


def test_graph_ops_use_torch_cuda_graphs(monkeypatch):
    fake_gpus(monkeypatch)
    made, captured = [], []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: made.append("g") or types.SimpleNamespace(
        replay=lambda: captured.append("replay")))
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, stream=None: captured.append((g, pool, stream))
                        or "ctx")
    acc = CudaAccelerator()
    g = acc.create_graph()
    assert acc.capture_to_graph(g, pool="p") == "ctx"
    acc.replay_graph(g)
    assert made == ["g"] and captured == [(g, "p", None), "replay"]


# ---------------------------------------------------------------------------------- triton
def test_triton_compatible_reasons(monkeypatch):
    ok, why = triton_support.triton_compatible(None)
    assert not ok and "no usable accelerator" in why
    from polyaccel.plugins.cpu.accelerator import CpuAccelerator

    ok, why = triton_support.triton_compatible(CpuAccelerator())
    assert not ok and "'cpu'" in why
    fake_gpus(monkeypatch, capability=(9, 0))
    ok, why = triton_support.triton_compatible(CudaAccelerator())
    assert not ok and "TRITON_INTERPRET" in why
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_support.triton_compatible(CudaAccelerator()) == (True, "")
    fake_gpus(monkeypatch, capability=(7, 0))
    ok, why = triton_support.triton_compatible(CudaAccelerator())
    assert not ok and "compute capability 7.0" in why
    fake_gpus(monkeypatch, capability=(9, 0))
    monkeypatch.setattr(triton_support, "triton_import", lambda: (False, "triton is not importable (boom)"))
    assert triton_support.triton_compatible(CudaAccelerator()) == (False, "triton is not importable (boom)")
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fake_gpus(monkeypatch, count=0)
    ok, why = triton_support.triton_compatible(CudaAccelerator())
    assert not ok and "not usable here" in why


def test_interpreter_available_only_under_triton_interpret(monkeypatch):
    assert triton_support.interpreter_available()[0]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = triton_support.interpreter_available()
    assert not ok and "TRITON_INTERPRET" in why


def test_triton_builders_chosen_on_a_gpu_and_explained_on_cpu(monkeypatch):
    monkeypatch.setenv("POLYACCEL_PLUGINS", "cpu,cuda")
    text = ops.explain("fused_adam", "cuda")
    assert "triton_fused_adam" in text and "incompatible" in text
    assert ops.registry.chosen("fused_adam", "cuda").name == "reference"
    fake_gpus(monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for op in ("fused_adam", "fused_lion", "fused_lamb"):
        chosen = ops.registry.chosen(op, "cuda")
        assert chosen.name == f"triton_{op}" and chosen.plugin == "cuda" and chosen.kind == "triton"


# -------------------------------------------------------------------------- host memory
def test_register_is_refcounted_and_exact(cudart):
    acc = CudaAccelerator()
    base = torch.randn(1000)
    t = base[10:510]
    assert acc.register_host_memory(t) is t
    acc.register_host_memory(t)
    assert cudart.calls == [("register", t.data_ptr(), (1000 - 10) * 4, cuda_acc.CUDA_HOST_REGISTER_PORTABLE)]
    assert acc.is_pinned(t) and acc.host_registrations() == {t.data_ptr(): 2}
    assert acc.unregister_host_memory(t) is False and len(cudart.calls) == 1
    assert acc.unregister_host_memory(t) is True
    assert cudart.calls[-1] == ("unregister", t.data_ptr()) and acc.host_registrations() == {}
    with pytest.raises(PolyaccelError, match="was not registered"):
        acc.unregister_host_memory(t)


def test_refused_registration_reports_the_code_and_clears_the_runtime_error(cudart):
    acc = CudaAccelerator()
    cudart.register_rc = 712
    t = torch.randn(64)
    with pytest.raises(PolyaccelError, match=r"error 712 \(part or all of the requested memory range"):
        acc.register_host_memory(t)
    assert acc.host_registrations() == {} and cudart.last_error == 0
    assert not acc.is_pinned(t)


def test_failed_unregister_leaks_instead_of_freeing(cudart):
    acc = CudaAccelerator()
    t = torch.randn(256)
    acc.register_host_memory(t)
    cudart.unregister_rc = 713
    before = len(host_registration.LEAKED_HOST_BUFFERS)
    with pytest.raises(PolyaccelError, match="never freed"):
        acc.unregister_host_memory(t)
    leaked = host_registration.LEAKED_HOST_BUFFERS[before:]
    assert len(leaked) == 1 and leaked[0].tensor is t and leaked[0].leaked
    assert cudart.last_error == 0
    host_registration.LEAKED_HOST_BUFFERS[before:] = []


def test_register_rejects_device_and_strided_tensors(cudart):
    acc = CudaAccelerator()
    with pytest.raises(PolyaccelError, match="contiguous"):
        acc.register_host_memory(torch.randn(8, 8).t())
    assert acc.register_host_memory(torch.empty(0)).numel() == 0 and cudart.calls == []


def test_runtime_function_finds_an_already_loaded_library():
    fn = cuda_acc.runtime_function("libc.so", "getpid")
    import os

    assert fn is not None and fn() == os.getpid()
    assert cuda_acc.runtime_function("libdoes-not-exist", "nothing_here") is None


# ------------------------------------------------------------------------------- hooks
def test_comm_hooks_and_report(monkeypatch):
    fake_gpus(monkeypatch)
    acc = CudaAccelerator()
    hooks = acc.comm_hooks()
    assert hooks.backend == "nccl" and hooks.pass_device_id is True
    from polyaccel.comm import resolve_hooks
    from polyaccel.plugins.cpu.accelerator import CpuAccelerator

    # the answers are the accelerator's own: no broadcast hook that other accelerators pass through
    assert not hasattr(cuda_plugin, "polyaccel_comm_hooks") and not hasattr(cuda_plugin, "polyaccel_report")
    assert resolve_hooks(CpuAccelerator()).pass_device_id is False
    rep = acc.report_facts()
    assert rep["collective_library"] == "nccl" and rep["devices"][0]["name"] == "Fake H200"
    assert rep["fp8_dtypes"] == ["float8_e4m3fn", "float8_e5m2"]
    assert "TRITON_INTERPRET" in rep["triton_builders"]


def test_op_builders_hook_gives_optimizers_and_kernel_builders():
    from polyaccel.ops import OpRegistry

    reg = OpRegistry()
    for builder in cuda_plugin.polyaccel_op_builders():
        reg.add(builder)
    names = {op: [b.name for b in reg.builders(op)] for op in reg.ops()}
    assert {"triton_fused_adam", "torch_fused_adam"} <= set(names["fused_adam"])
    assert names["fused_lion"] == ["triton_fused_lion"] and names["fused_lamb"] == ["triton_fused_lamb"]
    assert {"quantize", "swiglu", "grouped_mm"} <= set(names)  # the kernel builders of the same table


def test_torch_fused_adam_fallback_matches_reference():
    """The torch builder (torch._fused_adamw_) is plain torch: checkable on CPU tensors too."""
    from polyaccel.ops.reference import optimizers as ref
    from polyaccel.plugins.cuda.ops import torch_fused_adam

    g = torch.Generator().manual_seed(0)
    lists = [[torch.randn(n, generator=g) for n in (5, 0, 17)] for _ in range(3)]
    lists.append([torch.rand(n, generator=g) for n in (5, 0, 17)])
    want = [[t.double() for t in lst] for lst in lists]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3)
    torch_fused_adam(*lists, **kw)
    ref.fused_adam(*want, **kw)
    for a, b in zip(lists[0], want[0], strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
