"""npu graph ops route to torch.npu.NPUGraph/graph and replay really recomputes; streams and events."""

from __future__ import annotations

import polyaccel
import pytest
import torch
from polyaccel import Unsupported
from polyaccel.testing.emulation import emulate


def test_graph_ops_route_to_npugraph_and_replay_recomputes():
    with emulate("npu") as rt:
        acc = polyaccel.get_accelerator()
        dev = acc.device()
        x, w, b = torch.randn(32, 16, device=dev), torch.randn(16, 8, device=dev), torch.randn(8, device=dev)
        side = acc.Stream()
        graph = acc.create_graph()
        with acc.capture_to_graph(graph, stream=side):
            y = torch.relu(x @ w + b)
        assert rt.calls.last("graph").kwargs["stream"] is side
        assert rt.calls.last("NPUGraph.capture_end").args[0] >= 3, "capture recorded the work"
        for _ in range(3):
            fresh = torch.randn(32, 16)
            x.copy_(fresh)
            acc.replay_graph(graph)
            acc.synchronize()
            expected = torch.relu(fresh.double() @ w.double() + b.double())
            torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
        assert rt.calls.count_of("NPUGraph.replay") == 3 and graph.replays == 3


def test_replaying_an_uncaptured_graph_is_an_error():
    with emulate("npu"):
        acc = polyaccel.get_accelerator()
        with pytest.raises(RuntimeError, match="before capture"):
            acc.replay_graph(acc.create_graph())


def test_without_npugraph_graph_ops_are_unsupported():
    with emulate("npu", no_graphs=True):
        acc = polyaccel.get_accelerator()
        for call in (acc.create_graph, lambda: acc.capture_to_graph(None), lambda: acc.replay_graph(None)):
            with pytest.raises(Unsupported, match="npu") as info:
                call()
            assert "graphs" in str(info.value)


def test_events_complete_asynchronously_and_order_streams():
    with emulate("npu") as rt:
        acc = polyaccel.get_accelerator()
        rt.default_stream().queue.held = True
        done = acc.Event(enable_timing=True)
        start = acc.Event(enable_timing=True)
        start.record()
        done.record()
        assert not done.query(), "recorded work is not complete until the stream gets to it"
        side = acc.Stream()
        side.wait_event(done)
        assert done.query() and start.query()
        assert start.elapsed_time(done) >= 0.0
        assert "Stream.wait_event" in rt.calls.names()
        with acc.stream(side):
            assert acc.current_stream() == side
        assert acc.current_stream() == acc.default_stream()
