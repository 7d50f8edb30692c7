"""The emulation kit's building blocks: faults, call log, async completion, patcher, graph recorder."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from polyaccel import selection
from polyaccel.runtime import current
from polyaccel.testing.emulation import (
    EMULATED,
    AllocationTracker,
    AsyncQueue,
    CallLog,
    CallRecord,
    EmulatedEvent,
    EmulatedRuntime,
    EmulatedStream,
    Faults,
    GraphCaptureError,
    GraphRecorder,
    HostMemoryTable,
    MemoryCounters,
    Patcher,
    PinnedHost,
    emulation_fixture,
    is_emulated_module,
    mark_emulated,
    missing_library_error,
)


class _DemoRuntime(EmulatedRuntime):
    name = "demo"
    FAULTS = {"boom": "explodes", "broken_lib": "the library cannot be loaded"}

    def install(self, patcher):
        module = mark_emulated(types.ModuleType("polyaccel_demo_runtime"))
        patcher.set_module("polyaccel_demo_runtime", module)
        patcher.setattr(torch, "polyaccel_demo", module)
        patcher.setenv("POLYACCEL_DEMO_ENV", "on")
        if self.faults.broken_lib:
            patcher.fail_import("polyaccel_demo_native", missing_library_error("libdemo.so", "polyaccel_demo_native"))


def _emulate(**faults):
    return _DemoRuntime(**faults).activate()


demo_runtime = emulation_fixture(_emulate, boom=True)


def test_faults_reject_unknown_names_and_list_the_known_ones():
    with pytest.raises(TypeError, match=r"unknown fault 'bogus'.*boom \(explodes\)"):
        _DemoRuntime(bogus=True)
    faults = Faults("demo", {"a": "first"}, {"a": 5})
    assert faults.a == 5 and faults.active() == {"a": 5}
    faults.a = False
    assert faults.active() == {}
    with pytest.raises(TypeError, match="unknown fault 'b'"):
        faults.b = True
    with pytest.raises(AttributeError):
        _ = faults.b


def test_call_log_queries():
    log = CallLog([CallRecord("register", (1, 2)), CallRecord("query"), CallRecord("register", (3, 4))])
    assert log.names() == ["register", "query", "register"]
    assert log.count_of("register") == 2 and log.count_of("nothing") == 0
    assert log.last("register").args == (3, 4)
    assert [c.args for c in log.of("register")] == [(1, 2), (3, 4)]
    with pytest.raises(LookupError, match="never called with 'missing'"):
        log.last("missing")


def test_async_queue_completes_later_and_in_order():
    done = []
    q = AsyncQueue(polls_to_complete=2)
    first = q.submit(lambda: done.append("first") or 1, "first")
    second = q.submit(lambda: done.append("second") or 2, "second")
    assert not second.query() and not second.query()  # polled, but not yet complete
    assert done == []
    assert second.query()  # third poll completes it, and the work submitted before it first
    assert done == ["first", "second"] and first.done and second.result == 2
    q.held = True
    third = q.submit(lambda: done.append("third"))
    assert not any(third.query() for _ in range(10)), "a held queue must not complete work by polling"
    third.wait()
    assert done[-1] == "third" and q.pending() == []


def test_async_queue_advance_completes_oldest_first():
    q = AsyncQueue()
    items = [q.submit(label=str(i)) for i in range(4)]
    assert q.advance(2) == 2
    assert [c.done for c in items] == [True, True, False, False]
    q.synchronize()
    assert all(c.done for c in items)


def test_events_time_only_completed_work():
    rt = _DemoRuntime()
    start, end = EmulatedEvent(rt, enable_timing=True), EmulatedEvent(rt, enable_timing=True)
    with pytest.raises(RuntimeError, match="recorded"):
        start.elapsed_time(end)
    start.record()
    end.record()
    with pytest.raises(RuntimeError, match="completed"):
        start.elapsed_time(end)
    end.synchronize()  # completes the earlier event too (in-order stream)
    assert start.query() and end.query()
    assert start.elapsed_time(end) >= 0.0
    untimed = EmulatedEvent(rt)
    untimed.record()
    untimed.synchronize()
    with pytest.raises(RuntimeError, match="enable_timing"):
        untimed.elapsed_time(end)


def test_streams_are_separate_queues():
    rt = _DemoRuntime()
    a, b = EmulatedStream(rt), EmulatedStream(rt)
    ev = a.record_event()
    assert a != b and not ev._completion.done
    b.wait_stream(a)
    assert ev.query()
    assert rt.calls.names()[-1] == "Stream.wait_stream"


def test_patcher_restores_everything_even_after_an_error():
    old_mod = sys.modules.get("json")
    assert "POLYACCEL_DEMO_ENV" not in os.environ
    with pytest.raises(ValueError, match="inside"):
        with _emulate(broken_lib=True) as rt:
            assert rt.label == EMULATED and rt.active
            assert is_emulated_module(torch.polyaccel_demo)
            assert os.environ["POLYACCEL_DEMO_ENV"] == "on"
            with pytest.raises(ImportError, match="libdemo.so: cannot open shared object file"):
                import polyaccel_demo_native  # noqa: F401
            raise ValueError("inside")
    assert not hasattr(torch, "polyaccel_demo")
    assert "polyaccel_demo_runtime" not in sys.modules
    assert "POLYACCEL_DEMO_ENV" not in os.environ
    assert sys.modules.get("json") is old_mod
    with pytest.raises(ModuleNotFoundError):
        import polyaccel_demo_native  # noqa: F401  - the failing finder is gone too


def test_patcher_restores_replaced_attributes_and_modules():
    holder = types.SimpleNamespace(value=1)
    sentinel = types.ModuleType("json")
    real_json = sys.modules["json"]
    with Patcher(reset_selection=False) as p:
        p.setattr(holder, "value", 2)
        p.setattr(holder, "extra", 3)
        p.set_module("json", sentinel)
        p.delattr(holder, "value")
        assert not hasattr(holder, "value") and sys.modules["json"] is sentinel
    assert holder.value == 1 and not hasattr(holder, "extra") and sys.modules["json"] is real_json


def test_activation_resets_selection_on_enter_and_exit():
    selection.plugins()
    assert current().discovered
    with _emulate():
        assert not current().discovered
        selection.plugins()
    assert not current().discovered


def test_fixture_yields_the_runtime_with_its_faults(demo_runtime):
    assert isinstance(demo_runtime, _DemoRuntime) and demo_runtime.faults.boom is True
    assert hasattr(torch, "polyaccel_demo")


def test_graph_recorder_replay_recomputes_from_current_inputs():
    x, w = torch.randn(64), torch.randn(64)
    acc = torch.zeros(64)
    g = GraphRecorder()
    g.begin()
    y = torch.tanh(x * w) + 1.0
    acc.add_(y)  # in-place work is replayed as well
    g.end()
    for _ in range(3):
        new_x = torch.randn(64)
        x.copy_(new_x)
        before = acc.clone()
        g.replay()
        expected = torch.tanh(new_x.double() * w.double()) + 1.0
        torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(acc, before + y)
    assert g.replays == 3


def test_graph_recorder_errors():
    g = GraphRecorder()
    with pytest.raises(GraphCaptureError, match="before capture"):
        g.replay()
    x = torch.randn(4)
    g.begin()
    with pytest.raises(GraphCaptureError, match="not permitted when stream is capturing"):
        (x * 2).sum().item()
    g.end()
    with pytest.raises(GraphCaptureError, match="already captured"):
        g.begin()


def test_host_memory_table_codes():
    t = HostMemoryTable(alignment=4096, ok=0, invalid_value=11, already_registered=12, not_registered=13)
    assert t.register(4096, 8192, 2, allowed_flags=(2,)) == 0
    assert t.register(4096 * 2, 4096, 2, allowed_flags=(2,)) == 12  # overlaps
    assert t.register(4096 * 8 + 1, 4096, 2, allowed_flags=(2,)) == 11  # misaligned address
    assert t.register(4096 * 8, 100, 2, allowed_flags=(2,)) == 11  # misaligned length
    assert t.register(4096 * 8, 4096, 1, allowed_flags=(2,)) == 11  # flag not allowed
    assert t.covers(4096 + 10, 100) and not t.covers(4096 * 3, 1)
    assert t.unregister(4096 * 9) == 13
    assert t.unregister(4096) == 0 and t.ranges == {}


def test_allocation_tracker_counts_new_storages_once_and_frees_them():
    counters = MemoryCounters()
    with AllocationTracker(counters):
        a = torch.empty(1024, dtype=torch.float32)
        assert counters.allocated == 4096
        view = a[10:20]
        a.add_(1.0)
        assert counters.allocated == 4096, "views and in-place results reuse the storage"
        b = a * 2
        assert counters.allocated == 8192 and counters.peak == 8192
        del a, view
        assert counters.allocated == 4096
        del b
    assert counters.allocated == 0 and counters.peak == 8192
    counters.reset_peak()
    assert counters.peak == 0


def test_pinned_host_routes_plain_and_named_pin_calls_only():
    rt = _DemoRuntime()
    host = PinnedHost(rt)
    t = torch.randn(10)
    with Patcher(reset_selection=False) as p:
        host.install(p, "demo")
        pinned = t.pin_memory()
        assert torch.equal(pinned, t) and pinned.data_ptr() != t.data_ptr()
        assert pinned.is_pinned() and not t.is_pinned()
        assert t.pin_memory("demo:0").is_pinned("demo")
        with pytest.raises(RuntimeError):
            t.pin_memory("cuda")  # another device goes to torch, which has none here
        assert rt.calls.count_of("pin_memory") == 2
    with pytest.raises(RuntimeError):
        t.pin_memory()
