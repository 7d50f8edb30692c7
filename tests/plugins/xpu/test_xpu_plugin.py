"""xpu plugin under the emulated torch.xpu runtime: probe/selection, IPEX guard, comm, graphs, ops, memory."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from polyaccel import selection
from polyaccel.comm import resolve_hooks
from polyaccel.errors import ConfigError, Unsupported
from polyaccel.ops import registry
from polyaccel.ops.reference import optimizers as ref
from polyaccel.plugins.xpu import emulation as emulation
from polyaccel.report import build_report
from polyaccel.testing.emulation import emulate
from polyaccel.testing.numerics import assert_close_to_reference


def _record(name):
    return selection.plugins().records[name]


def _adam_inputs(shapes, param_dtype, state_dtype):
    params = [torch.randn(s).to(param_dtype) for s in shapes]
    grads = [torch.randn(s).to(param_dtype) for s in shapes]
    exp_avgs = [(torch.randn(s) * 0.1).to(state_dtype) for s in shapes]
    exp_avg_sqs = [(torch.rand(s) * 0.01).to(state_dtype) for s in shapes]
    return params, grads, exp_avgs, exp_avg_sqs


def _check_adam(fn, param_dtype, state_dtype, **overrides):
    lists = _adam_inputs([(33,), (7, 19), (1, 257)], param_dtype, state_dtype)
    expected = [[t.double().clone() for t in lst] for lst in lists]
    kw = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=4, adam_w_mode=True,
              bias_correction=True)
    kw.update(overrides)
    fn(*lists, **kw)
    ref.fused_adam(*expected, **kw)
    for got, want in zip(lists[0], expected[0], strict=True):
        assert_close_to_reference(got, want, param_dtype, "param")
    for got, want in zip(lists[2], expected[2], strict=True):
        assert_close_to_reference(got, want, state_dtype, "exp_avg")


# ------------------------------------------------------------------------- probe and selection
def test_not_selected_without_emulation_and_report_says_why(capsys):
    from polyaccel.cli import main

    main(["report", "--json"])
    rep = json.loads(capsys.readouterr().out)
    row = next(p for p in rep["plugins"] if p["name"] == "xpu")
    assert row["status"] == "unavailable" and not row["emulated"]
    assert "without XPU support" in row["reason"] and "download.pytorch.org/whl/xpu" in row["reason"]
    assert rep["selected"]["name"] != "xpu"


def test_selected_under_emulation():
    with emulate("xpu", device_count=3) as rt:
        acc = selection.get_accelerator()
        assert acc.name == "xpu" and acc.is_emulated()
        rec = _record("xpu")
        assert rec.status == "selected" and rec.emulated and rec.probe.device_count == 3
        assert "is_available" in rt.calls.names()
        rep = build_report()
        assert rep["selected"]["name"] == "xpu" and rep["selected"]["emulated"] is True
        assert rep["extra"]["xpu"]["communication_backend"] == "xccl"
    assert _record("xpu").status == "unavailable"  # leaving the emulation restores the real answer


def test_no_device_is_unavailable_with_reason():
    with emulate("xpu", no_device=True):
        rec = _record("xpu")
        assert rec.status == "unavailable"
        assert "no Intel GPU" in rec.reason and "ZE_AFFINITY_MASK" in rec.reason
        assert selection.get_accelerator().name != "xpu"


def test_capabilities_follow_the_device():
    with emulate("xpu"):
        caps = selection.get_accelerator().capabilities()
        assert {"streams", "events", "graphs", "pinned", "memory_stats", "rng", "bf16", "fp16", "fp64"} <= caps
        assert "host_register" not in caps
    with emulate("xpu", no_fp64=True, no_bf16=True, no_graphs=True):
        caps = selection.get_accelerator().capabilities()
        assert not {"fp64", "bf16", "graphs"} & caps


# ------------------------------------------------------------------------------------- IPEX
def test_mismatched_ipex_with_metadata_is_never_imported():
    with emulate("xpu", ipex="2.8.0") as rt:
        acc = selection.get_accelerator()
        assert acc.name == "xpu"
        status = acc.ipex_status()
        assert not status.used and status.version == "2.8.0"
        assert "2.8.*" in status.reason and torch.__version__ in status.reason
        assert "ipex.import" not in rt.calls.names()
        assert emulation.IPEX_MODULE not in sys.modules
        extra = build_report()["extra"]["xpu"]
        assert extra["ipex_used"] is False and extra["ipex"].startswith("ignored")


@pytest.mark.parametrize("exit_call", ["os.exit", "sys.exit"])
def test_mismatched_ipex_import_cannot_end_the_process(exit_call, capsys):
    saved = (sys.exit, os._exit)
    with emulate("xpu", ipex="2.8.0", ipex_no_metadata=True, ipex_exit=exit_call) as rt:
        status = selection.get_accelerator().ipex_status()
        assert rt.calls.count_of("ipex.import") == 1  # no metadata: the version is learnt by importing
        assert not status.used and "tried to end the process" in status.reason and exit_call in status.reason
        assert "needs to work with PyTorch 2.8.*" in capsys.readouterr().out
        assert emulation.IPEX_MODULE not in sys.modules  # the half-imported module is forgotten
    assert (sys.exit, os._exit) == saved and not hasattr(os, "exit")


def test_emulated_ipex_refuses_like_the_release():
    """Unguarded, the stand-in fails exactly as the released package does: os.exit does not exist."""
    with emulate("xpu", ipex="2.7.0"):
        with pytest.raises(AttributeError, match="'os' has no attribute 'exit'"):
            import intel_extension_for_pytorch  # noqa: F401


def test_matching_ipex_is_used():
    with emulate("xpu", ipex="match") as rt:
        status = selection.get_accelerator().ipex_status()
        assert status.used and status.reason.startswith("used")
        assert rt.calls.count_of("ipex.import") == 1


def test_ipex_without_a_device_is_mentioned_in_the_reason():
    with emulate("xpu", no_device=True, ipex="2.6.0") as rt:
        rec = _record("xpu")
        assert rec.status == "unavailable" and "intel-extension-for-pytorch 2.6.0" in rec.reason
        extra = build_report()["extra"]["xpu"]  # said even when another accelerator is selected
        assert extra["ipex_version"] == "2.6.0" and "works only with torch 2.6.*" in extra["ipex"]
        assert "ipex.import" not in rt.calls.names()


# ------------------------------------------------------------------------------------- comm
def test_comm_backend_names():
    with emulate("xpu"):
        hooks = resolve_hooks(selection.get_accelerator())
        assert hooks.backend == "xccl" and hooks.supports_device_tensors
    with emulate("xpu", no_xccl=True, oneccl=True):
        acc = selection.get_accelerator()
        assert resolve_hooks(acc).backend == "ccl" and acc.communication_backend == "ccl"
        assert "oneCCL bindings" in acc.comm_choice().reason
    with emulate("xpu", no_xccl=True):
        acc = selection.get_accelerator()
        assert acc.communication_backend == "unavailable"
        with pytest.raises(ConfigError, match="no collective backend for xpu.*oneccl_bindings_for_pytorch"):
            resolve_hooks(acc)


# ----------------------------------------------------------------------------------- graphs
def test_graph_capture_and_replay_recompute():
    with emulate("xpu") as rt:
        acc = selection.get_accelerator()
        x = torch.randn(64)
        y = torch.empty(64)
        g = acc.create_graph()
        with acc.capture_to_graph(g):
            y.copy_(torch.tanh(x) * 2 + 1)
        x.copy_(torch.randn(64))
        acc.replay_graph(g)
        torch.testing.assert_close(y, torch.tanh(x) * 2 + 1)
        assert rt.calls.names()[-3:] == ["XPUGraph.capture_begin", "XPUGraph.capture_end", "XPUGraph.replay"]


def test_graphs_unsupported_where_torch_has_none():
    with emulate("xpu", no_graphs=True):
        acc = selection.get_accelerator()
        for call in (acc.create_graph, lambda: acc.capture_to_graph(object()), lambda: acc.replay_graph(object())):
            with pytest.raises(Unsupported, match="'xpu' does not support graphs.*XPUGraph") as info:
                call()
            assert info.value.plugin == "xpu" and info.value.feature == "graphs"


# -------------------------------------------------------------------------------------- ops
@pytest.mark.parametrize("param_dtype,state_dtype", [(torch.float32, torch.float32),
                                                     (torch.bfloat16, torch.float32)])
def test_fused_adam_routes_to_torch_fused_kernel(param_dtype, state_dtype):
    with emulate("xpu"):
        selection.get_accelerator()
        fn = registry.resolve("fused_adam", "xpu")
        assert registry._chosen[("fused_adam", "xpu")].name == "xpu_torch_fused_adam"
        _check_adam(fn, param_dtype, state_dtype)
        _check_adam(fn, param_dtype, state_dtype, adam_w_mode=False, bias_correction=False,
                    step=torch.tensor(7.0))


def test_fused_adam_falls_back_to_reference_without_a_fused_kernel():
    with emulate("xpu", no_fused_adam=True):
        selection.get_accelerator()
        chosen = next(c for c in registry.candidates("fused_adam", "xpu") if c.chosen)
        assert chosen.builder.name == "reference"
        ours = next(c for c in registry.candidates("fused_adam", "xpu") if c.builder.name == "xpu_torch_fused_adam")
        assert "no fused Adam kernel for device type 'xpu'" in ours.reason
        _check_adam(registry.resolve("fused_adam", "xpu"), torch.float32, torch.float32)
    chosen = next(c for c in registry.candidates("fused_lion", "xpu") if c.chosen)
    assert chosen.builder.name == "reference"


# --------------------------------------------------------------- pinned memory, streams, RNG, memory
def test_pinned_memory_through_torch_xpu_pinning():
    with emulate("xpu") as rt:
        acc = selection.get_accelerator()
        host = torch.randn(300)
        assert not acc.is_pinned(host)
        pinned = acc.pin_memory(host)
        assert acc.is_pinned(pinned) and torch.equal(pinned, host) and pinned.data_ptr() != host.data_ptr()
        assert acc.pin_memory(pinned) is pinned
        assert rt.calls.count_of("pin_memory") == 1
        assert acc.is_pinned(acc.empty_pinned((4, 4), torch.float16))
        with pytest.raises(Unsupported, match="host_register"):
            acc.register_host_memory(host)


def test_streams_events_rng_memory():
    with emulate("xpu", polls_to_complete=2) as rt:
        acc = selection.get_accelerator()
        side = acc.Stream()
        with acc.stream(side):
            assert acc.current_stream() == side
        assert acc.default_stream() != side
        ev = acc.Event(enable_timing=True)
        ev.record()
        assert not ev.query()  # asynchronous: completes later
        ev.synchronize()
        assert ev.query()
        acc.manual_seed(11)
        a = torch.randn(16, device=acc.device())
        state = acc.get_rng_state()
        b = torch.randn(16, device=acc.device())
        acc.set_rng_state(state)
        assert torch.equal(torch.randn(16, device=acc.device()), b) and not torch.equal(a, b)
        before = acc.memory_allocated()
        block = torch.empty(1 << 18, device=acc.device())
        assert acc.memory_allocated() >= before + block.numel() * 4
        del block
        assert acc.memory_allocated() <= before + (1 << 16)
        acc.set_device(1)
        assert acc.current_device() == 1 and ("set_device", (1,)) in [(c.name, c.args) for c in rt.calls]
        with pytest.raises(RuntimeError, match="invalid device ordinal 5"):
            acc.set_device(5)
        assert math.isfinite(acc.total_memory())
