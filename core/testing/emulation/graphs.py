"""Device graphs, emulated: capture records the aten ops run on the host, replay runs them again."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .marker import mark_emulated
from .memory import tensors_in

if TYPE_CHECKING:
    from .runtime import EmulatedRuntime


class GraphCaptureError(RuntimeError):
    pass


class _RecordingMode(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise GraphCaptureError(
                "operation not permitted when stream is capturing: a host synchronisation "
                "(.item(), printing a tensor, data-dependent control flow) inside graph capture"
            )
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class GraphRecorder:
    """Capture = record the aten ops run on the host; replay = run them again.

    Each replay re-executes the recorded ops against the *same* tensors (the static
    inputs and every intermediate the capture allocated) and writes results into the
    captured outputs, so a replay after changing an input's contents recomputes, exactly
    as a device graph does. A host sync inside capture raises, as on device.
    """

    def __init__(self) -> None:
        self.ops: list = []
        self.captured = False
        self.replays = 0
        self._mode: _RecordingMode | None = None

    def begin(self) -> None:
        if self.captured:
            raise GraphCaptureError("this graph was already captured; create a new graph to capture again")
        self._mode = _RecordingMode(self.ops)
        self._mode.__enter__()

    def end(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self.captured = True

    def replay(self) -> None:
        if not self.captured:
            raise GraphCaptureError("replay() before capture: capture work into the graph first")
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                fresh = func(*args, **kwargs)
                for dst, src in zip(tensors_in(out), tensors_in(fresh), strict=True):
                    if dst is not src and dst.data_ptr() != src.data_ptr():
                        dst.copy_(src)
        self.replays += 1

    def reset(self) -> None:
        self.ops.clear()
        self.captured = False


class EmulatedGraph:
    """A vendor's device-graph class (``torch.<device>.<Vendor>Graph``) on a
    :class:`GraphRecorder`: capture records, replay really recomputes. Subclasses set ``api_name``,
    the name under which the runtime records the calls."""

    api_name = "Graph"

    def __init__(self, runtime: EmulatedRuntime):
        self._rt = runtime
        self._rec = GraphRecorder()
        mark_emulated(self)

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        self._rt.record(f"{self.api_name}.capture_begin")
        self._rec.begin()

    def capture_end(self) -> None:
        self._rec.end()
        self._rt.record(f"{self.api_name}.capture_end", len(self._rec.ops))

    def replay(self) -> None:
        self._rt.record(f"{self.api_name}.replay")
        self._rec.replay()

    def reset(self) -> None:
        self._rec.reset()

    def pool(self) -> tuple[int, int]:
        return (id(self), 0)

    @property
    def replays(self) -> int:
        return self._rec.replays


def install_graph_api(module: Any, rt: EmulatedRuntime, graph_cls: type[EmulatedGraph]) -> None:
    """Give an emulated ``torch.<device>`` module ``<api_name>()``, ``graph(g, pool, stream)`` and
    ``graph_pool_handle()``; created graphs are kept in ``rt.graphs``."""

    def make_graph() -> EmulatedGraph:
        g = graph_cls(rt)
        rt.graphs.append(g)
        return g

    @contextlib.contextmanager
    def graph(device_graph: EmulatedGraph, pool=None, stream=None, capture_error_mode: str = "global"):
        rt.record("graph", pool=pool, stream=stream)
        with rt.use_stream(stream):
            device_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
            try:
                yield device_graph
            finally:
                device_graph.capture_end()

    setattr(module, graph_cls.api_name, make_graph)
    module.graph = graph
    module.graph_pool_handle = lambda: (id(rt), 1)
