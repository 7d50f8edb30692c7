"""The base class's defaults: the device module first, torch's device-generic APIs where it has nothing,
graphs only through torch.accelerator.Graph (never another backend's graph class), else Unsupported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from polyaccel.accelerator import Accelerator, ProbeResult
from polyaccel.errors import PolyaccelError, Unsupported


def _refuse(*args, **kwargs):
    raise AssertionError("the base class called a backend-specific graph API")


class ModuleBacked(Accelerator):
    """A plugin whose device module is ``self.module``; claims what ``self.claims`` says."""

    name = "modulebacked"
    device_type = "fakedev"

    def __init__(self, module, claims=(), torch_serves=False):
        super().__init__()
        self.module, self.claims, self.torch_serves = module, frozenset(claims), torch_serves

    def probe(self):
        return ProbeResult(True, "", 1)

    def capabilities(self):
        return self.claims

    def _device_module(self, required=True):
        return self.module

    def _torch_accelerator_serves(self):
        return self.torch_serves


GRAPH_CALLS = (
    ("create_graph()", lambda acc: acc.create_graph()),
    ("capture_to_graph()", lambda acc: acc.capture_to_graph(object())),
    ("replay_graph()", lambda acc: acc.replay_graph(object())),
)


@pytest.mark.parametrize("what,call", GRAPH_CALLS, ids=[c[0] for c in GRAPH_CALLS])
def test_graphs_are_unsupported_in_the_base_class_when_not_claimed(what, call):
    acc = ModuleBacked(SimpleNamespace(CUDAGraph=_refuse, graph=_refuse))
    with pytest.raises(Unsupported, match="'modulebacked' does not support graphs") as info:
        call(acc)
    assert (info.value.plugin, info.value.feature) == ("modulebacked", "graphs")


@pytest.mark.parametrize("what,call", GRAPH_CALLS[:2], ids=[c[0] for c in GRAPH_CALLS[:2]])
def test_a_claimed_graph_without_torch_accelerator_graph_is_unsupported_not_a_cuda_graph(what, call):
    """Claiming graphs is not enough: the base has no graph of its own, and never borrows CUDA's."""
    acc = ModuleBacked(SimpleNamespace(CUDAGraph=_refuse, graph=_refuse), claims={"graphs"})
    with pytest.raises(Unsupported, match=r"torch\.accelerator\.Graph.*must name its graph_class or implement"):
        call(acc)


def test_a_named_graph_class_is_made_and_captured_through_the_device_module():
    made, captures = [], []

    class FakeGraph:
        def __init__(self):
            made.append(self)

        def replay(self):
            made.append("replay")

    def graph(g, pool=None, stream=None):
        captures.append((g, pool, stream))
        return "capture-context"

    class Named(ModuleBacked):
        graph_class = "FakeGraph"

    acc = Named(SimpleNamespace(FakeGraph=FakeGraph, graph=graph, CUDAGraph=_refuse), claims={"graphs"})
    g = acc.create_graph()
    assert made == [g]
    assert acc.capture_to_graph(g, pool="pool", stream="side") == "capture-context"
    assert captures == [(g, "pool", "side")]
    acc.replay_graph(g)
    assert made[-1] == "replay"
    unclaimed = Named(SimpleNamespace(FakeGraph=FakeGraph, graph=graph))
    with pytest.raises(Unsupported, match="torch.fakedev has no FakeGraph"):
        unclaimed.create_graph()


def test_device_functions_come_from_the_device_module_first():
    calls = []
    module = SimpleNamespace(memory_allocated=lambda i: calls.append(("module", i)) or 7,
                             mem_get_info=lambda i: (3, 10))
    acc = ModuleBacked(module, claims={"memory_stats"}, torch_serves=True)
    assert acc.memory_allocated(0) == 7 and calls == [("module", 0)]
    assert (acc.available_memory(), acc.total_memory()) == (3, 10)


def test_what_the_device_module_lacks_comes_from_torch_accelerator(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda i: calls.append(("generic", i)) or 5)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda i: (1, 8))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 2)
    acc = ModuleBacked(SimpleNamespace(), claims={"memory_stats"}, torch_serves=True)
    assert acc.memory_allocated(1) == 5 and calls == [("generic", 1)]
    assert (acc.available_memory(1), acc.total_memory(1)) == (1, 8)
    assert acc.current_device() == 2


def test_neither_the_module_nor_torch_accelerator_having_it_is_unsupported():
    acc = ModuleBacked(SimpleNamespace(), claims={"memory_stats"})
    with pytest.raises(Unsupported, match=r"torch\.fakedev\.memory_allocated.*torch\.accelerator\.memory_allocated"):
        acc.memory_allocated()
    with pytest.raises(Unsupported, match="must implement it"):
        acc.device_count()


def test_streams_and_events_fall_back_to_torch_stream_and_event():
    """A device module without Stream/Event classes gets torch's generic ones (here on the host type)."""

    class HostModule(ModuleBacked):
        device_type = "cpu"

    acc = HostModule(SimpleNamespace(), claims={"streams", "events"}, torch_serves=True)
    stream = acc.Stream()
    assert type(stream) is torch.Stream and stream.device.type == "cpu"
    with acc.stream(stream):
        pass
    assert type(acc.Event(enable_timing=False)) is torch.Event
    with pytest.raises(Unsupported, match=r"torch\.Stream"):
        HostModule(SimpleNamespace(), claims={"streams"}).Stream()


def test_a_refused_unregistration_says_the_buffer_is_kept_alive():
    acc = ModuleBacked(SimpleNamespace())
    err = acc.runtime_call_error("hostUnregister(0x10)", 3, "busy", unregistering=True)
    assert isinstance(err, PolyaccelError)
    assert str(err) == ("modulebacked: hostUnregister(0x10) failed with error 3 (busy); the buffer is kept alive "
                        "(never freed) because the device may still access it")
    assert str(acc.runtime_call_error("hostRegister(0x10)", 1, hint="not registered")) == (
        "modulebacked: hostRegister(0x10) failed with error 1; not registered")


def test_a_plugin_claiming_graphs_is_wired_to_torch_accelerator_graph(monkeypatch):
    """Without a GPU: the default path makes ``torch.accelerator.Graph``, captures inside it on a fresh side
    stream (runtimes refuse the default stream), passes the pool on, and replays it. The test below runs it
    for real where there is a GPU."""
    events = []

    class FakeGraph:
        def __enter__(self):
            events.append("capture")
            return self

        def __exit__(self, *exc):
            events.append("end")

        def replay(self):
            events.append("replay")

    class HostModule(ModuleBacked):
        device_type = "cpu"

        def Stream(self, *args, **kwargs):  # noqa: N802 - the contract's name
            events.append("side stream")
            return super().Stream(*args, **kwargs)

    monkeypatch.setattr(torch.accelerator, "Graph", FakeGraph, raising=False)
    acc = HostModule(SimpleNamespace(), claims={"graphs", "streams", "events"}, torch_serves=True)
    graph = acc.create_graph()
    assert type(graph) is FakeGraph
    pool = object()
    with acc.capture_to_graph(graph, pool=pool) as captured:
        assert captured is graph and events == ["side stream", "capture"]
    assert graph.graph_pool is pool and events[-1] == "end"
    acc.replay_graph(graph)
    assert events[-1] == "replay"


@pytest.mark.skipif(not (torch.cuda.is_available() and hasattr(torch.accelerator, "Graph")),
                    reason="needs a GPU and torch.accelerator.Graph")
def test_a_plugin_claiming_graphs_gets_torch_accelerator_graph_on_a_device_torch_serves():
    class GenericGpu(Accelerator):
        name = "genericgpu"
        device_type = torch.accelerator.current_accelerator().type

        def probe(self):
            return ProbeResult(True, "", torch.accelerator.device_count())

        def capabilities(self):
            return frozenset({"graphs", "streams", "events"})

    acc = GenericGpu()
    x = torch.randn(1031, device=acc.device())
    graph = acc.create_graph()
    assert isinstance(graph, torch.accelerator.Graph)
    with acc.capture_to_graph(graph):
        y = x * 2.0 + 1.0
    for _ in range(2):
        x.copy_(torch.randn(1031, device=acc.device()))
        acc.replay_graph(graph)
        acc.synchronize()
        torch.testing.assert_close(y, x * 2.0 + 1.0)


def test_visible_device_variables_are_the_plugins_answer():
    """Launchers (DeepSpeed's among them) ask the accelerator which variable narrows the visible devices:
    none in the base, each backend's own where it has one."""
    from polyaccel.plugins.cuda.accelerator import CudaAccelerator
    from polyaccel.plugins.npu.accelerator import NpuAccelerator
    from polyaccel.plugins.rocm.accelerator import RocmAccelerator
    from polyaccel.plugins.supa.accelerator import SupaAccelerator

    assert ModuleBacked(SimpleNamespace()).visible_devices_envs() == []
    assert CudaAccelerator().visible_devices_envs() == RocmAccelerator().visible_devices_envs() == [
        "CUDA_VISIBLE_DEVICES"]
    assert NpuAccelerator().visible_devices_envs() == ["ASCEND_RT_VISIBLE_DEVICES"]
    assert SupaAccelerator().visible_devices_envs() == ["SUPA_VISIBLE_DEVICES"]
