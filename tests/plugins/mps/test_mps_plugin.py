"""mps plugin under the emulated torch.mps runtime: selection, unified memory, no graphs, the Metal FusedAdam."""

from __future__ import annotations

import json

import pytest
import torch
from polyaccel import selection
from polyaccel.comm import resolve_hooks
from polyaccel.errors import Unsupported
from polyaccel.ops import registry
from polyaccel.ops.reference import optimizers as ref
from polyaccel.report import build_report
from polyaccel.testing.emulation import emulate
from polyaccel.testing.numerics import assert_close_to_reference

SHAPES = [(33,), (7, 19), (1, 257)]


def _adam_inputs(param_dtype, state_dtype, shapes=SHAPES):
    params = [torch.randn(s).to(param_dtype) for s in shapes]
    grads = [torch.randn(s).to(param_dtype) for s in shapes]
    exp_avgs = [(torch.randn(s) * 0.1).to(state_dtype) for s in shapes]
    exp_avg_sqs = [(torch.rand(s) * 0.01).to(state_dtype) for s in shapes]
    return params, grads, exp_avgs, exp_avg_sqs


def _check_adam(fn, param_dtype, state_dtype, lists=None, **overrides):
    lists = lists or _adam_inputs(param_dtype, state_dtype)
    expected = [[t.double().clone() for t in lst] for lst in lists]
    kw = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=4, adam_w_mode=True,
              bias_correction=True)
    kw.update(overrides)
    fn(*lists, **kw)
    ref.fused_adam(*expected, **kw)
    for name, i, dtype in (("param", 0, param_dtype), ("exp_avg", 2, state_dtype), ("exp_avg_sq", 3, state_dtype)):
        for got, want in zip(lists[i], expected[i], strict=True):
            assert_close_to_reference(got, want, dtype, name)


def _chosen(op="fused_adam"):
    return next(c for c in registry.candidates(op, "mps") if c.chosen).builder.name


# ------------------------------------------------------------------------- probe and selection
def test_not_selected_without_emulation_and_report_says_why(capsys):
    from polyaccel.cli import main

    main(["report", "--json"])
    rep = json.loads(capsys.readouterr().out)
    row = next(p for p in rep["plugins"] if p["name"] == "mps")
    assert row["status"] == "unavailable" and not row["emulated"]
    assert "built without MPS" in row["reason"] and "Apple silicon" in row["reason"]
    assert rep["selected"]["name"] != "mps"


def test_selected_under_emulation():
    with emulate("mps"):
        acc = selection.get_accelerator()
        assert acc.name == "mps" and acc.is_emulated()
        rec = selection.plugins().records["mps"]
        assert rec.status == "selected" and rec.emulated and rec.probe.device_count == 1
        assert acc.capabilities() == {"events", "rng", "pinned", "fp16", "bf16"}
        assert acc.is_synchronized_device()
        rep = build_report()
        assert rep["selected"]["emulated"] and "shared allocator" in rep["extra"]["mps"]["unified_memory"]
        with pytest.raises(Exception, match="single device"):
            acc.set_device(1)


@pytest.mark.parametrize("fault,words", [("no_device", "is_available() is False"), ("not_built", "built without MPS")])
def test_unavailable_reasons(fault, words):
    with emulate("mps", **{fault: True}):
        rec = selection.plugins().records["mps"]
        assert rec.status == "unavailable" and words in rec.reason
        assert selection.get_accelerator().name != "mps"


def test_no_bf16_before_macos_14():
    with emulate("mps", macos13=True):
        caps = selection.get_accelerator().capabilities()
        assert "bf16" not in caps and "fp16" in caps and "fp64" not in caps


def test_no_graphs_no_streams():
    with emulate("mps"):
        acc = selection.get_accelerator()
        for call in (acc.create_graph, lambda: acc.capture_to_graph(None), lambda: acc.replay_graph(None)):
            with pytest.raises(Unsupported, match="'mps' does not support graphs") as info:
                call()
            assert info.value.plugin == "mps" and info.value.feature == "graphs"
        with pytest.raises(Unsupported, match="streams"):
            acc.Stream()
        with acc.stream(None):  # None is the documented explicit no-op
            pass


# ------------------------------------------------------------------------------ unified memory
def test_pin_memory_copies_once_into_the_shared_allocator():
    with emulate("mps") as rt:
        acc = selection.get_accelerator()
        host = torch.randn(500)
        assert not acc.is_pinned(host)
        pinned = acc.pin_memory(host)
        assert acc.is_pinned(pinned) and torch.equal(pinned, host) and pinned.data_ptr() != host.data_ptr()
        assert acc.pin_memory(pinned) is pinned
        assert rt.calls.count_of("pin_memory") == 1
        assert acc.is_pinned(acc.empty_pinned((3, 5), torch.float32))


def test_host_registration_is_unsupported():
    with emulate("mps"):
        acc = selection.get_accelerator()
        host = torch.randn(64)
        for call in (acc.register_host_memory, acc.unregister_host_memory):
            with pytest.raises(Unsupported, match="host_register.*without a copy") as info:
                call(host)
            assert info.value.plugin == "mps"
        assert acc.host_registrations() == {}


# ------------------------------------------------------------------------ Metal FusedAdam kernel
@pytest.mark.parametrize("param_dtype,state_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float32), (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_metal_fused_adam_matches_reference(param_dtype, state_dtype):
    with emulate("mps") as rt:
        selection.get_accelerator()
        fn = registry.resolve("fused_adam", "mps")
        assert _chosen() == "mps_metal_fused_adam"
        _check_adam(fn, param_dtype, state_dtype)
        _check_adam(fn, param_dtype, state_dtype, adam_w_mode=False, bias_correction=False, step=torch.tensor(9.0))
        sources = [c.args[0] for c in rt.calls.of("compile_shader")]
        assert len(sources) == 1, "one library per dtype pair, compiled once and cached"
        assert "#include <metal_stdlib>" in sources[0] and "[[thread_position_in_grid]]" in sources[0]
        dispatches = rt.calls.of("dispatch")
        assert len(dispatches) == 2 * len(SHAPES) and fn.fallback_calls == 0
        assert {d.kwargs["threads"] for d in dispatches} == {33, 7 * 19, 257}


def test_emulated_dispatch_checks_bindings_like_torch():
    """A Python int binds as 64-bit long and a buffer must hold the declared type: mistakes fail, not pass."""
    with emulate("mps"):
        from polyaccel.plugins.mps import metal_adam

        lib = torch.mps.compile_shader(metal_adam.kernel_source(torch.float32, torch.float32))
        kernel = getattr(lib, metal_adam.kernel_name(torch.float32, torch.float32))
        p, g, m, v = (torch.randn(8) for _ in range(4))
        scalars = [1e-3, 0.9, 0.999, 1e-8, 0.0, 0.5, 0.5, 1, 8]
        with pytest.raises(TypeError, match="binds as `float`"):
            kernel(p, g, m, v, *scalars[:7], 1.0, 8)
        with pytest.raises(TypeError, match="binds as 64-bit `long`"):
            kernel(p, g, m, v, 1, *scalars[1:])
        with pytest.raises(TypeError, match=r"`float\*`"):
            kernel(p.half(), g, m, v, *scalars)
        with pytest.raises(RuntimeError, match="takes 13 arguments"):
            kernel(p, g, m, v, *scalars[:-1])
        with pytest.raises(RuntimeError, match="does not compile"):
            torch.mps.compile_shader("kernel void broken(device float* x, uint i [[thread_position_in_grid]]) "
                                     "{ x[i] = ; }")


def test_metal_kernel_falls_back_per_call():
    with emulate("mps") as rt:
        selection.get_accelerator()
        fn = registry.resolve("fused_adam", "mps")
        # moments in a narrower type than the params: no kernel for the pair, torch's path instead
        _check_adam(fn, torch.float32, torch.bfloat16)
        # non-contiguous params
        base = _adam_inputs(torch.float32, torch.float32, [(12, 10)])
        strided = tuple([t.t() for t in lst] for lst in base)
        _check_adam(fn, torch.float32, torch.float32, lists=strided)
        assert fn.fallback_calls == 2 and rt.calls.count_of("dispatch") == 0


def test_rejected_shader_falls_back_to_torch_fused_adam():
    with emulate("mps", shader_compile_error=True) as rt:
        selection.get_accelerator()
        fn = registry.resolve("fused_adam", "mps")
        _check_adam(fn, torch.float32, torch.float32)
        assert fn.fallback_calls == 1 and rt.calls.count_of("compile_shader") == 1
        assert "failed to compile" in fn.compile_errors[(torch.float32, torch.float32)]
        _check_adam(fn, torch.float32, torch.float32)
        assert rt.calls.count_of("compile_shader") == 1, "a rejected source is not recompiled every step"


def test_without_compile_shader_torch_fused_adam_then_reference():
    with emulate("mps", no_compile_shader=True):
        selection.get_accelerator()
        assert _chosen() == "mps_torch_fused_adam"
        metal = next(c for c in registry.candidates("fused_adam", "mps") if c.builder.name == "mps_metal_fused_adam")
        assert "no torch.mps.compile_shader" in metal.reason
        _check_adam(registry.resolve("fused_adam", "mps"), torch.float32, torch.float32)
        _check_adam(registry.resolve("fused_adam", "mps"), torch.bfloat16, torch.float32)
    with emulate("mps", no_compile_shader=True, no_fused_adam=True):
        selection.get_accelerator()
        assert _chosen() == "reference"
        assert _chosen("fused_lion") == "mps_foreach_fused_lion"  # foreach needs no fused kernel


def test_comm_hooks_stage_through_host_buffers():
    with emulate("mps"):
        acc = selection.get_accelerator()
        hooks = resolve_hooks(acc)
        assert hooks.backend == "gloo" and not hooks.supports_device_tensors and hooks.stages
        # the emulated device's tensors are host tensors, and they are staged like real mps tensors
        assert hooks.needs_staging(torch.ones(2), acc)
