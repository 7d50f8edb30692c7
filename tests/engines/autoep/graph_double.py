"""A CPU stand-in for device graphs, for testing code that captures and replays them.

A device graph records the kernels a block launches and replays them on the same memory. Here
capture records every aten op the block dispatches (autograd's backward ops included) with the
very tensors it read and wrote; replay runs each op again in order and writes its result into
the recorded output, so later ops read fresh values, exactly as kernels replayed on fixed
addresses do. As on a device, a host read while capturing is refused (a device graph cannot
contain one), and Python decisions taken during capture are frozen.
"""

from __future__ import annotations

import contextlib

import torch
from polyaccel.errors import Unsupported
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default}


class HostReadDuringCapture(RuntimeError):
    pass


class _Record(TorchDispatchMode):
    def __init__(self, ops: list) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise HostReadDuringCapture(f"{func} reads a device value back to the host while capturing")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class RecordedAtenGraph:
    """``pool()`` names its memory pool as a device graph's does: the one it was captured into (``pool=``),
    else a new one (there is no memory to share here; tests check which pool each capture was given)."""

    def __init__(self) -> None:
        self.ops: list | None = None
        self.replays = 0
        self.given_pool = None
        self._pool = object()

    def pool(self):
        return self.given_pool if self.given_pool is not None else self._pool

    @contextlib.contextmanager
    def capture(self):
        assert self.ops is None, "captured twice"
        ops: list = []
        with _Record(ops):
            yield self
        self.ops = ops

    def replay(self) -> None:
        assert self.ops is not None, "replay before capture"
        with torch.no_grad():
            for func, args, kwargs, recorded in self.ops:
                fresh = func(*args, **kwargs)
                for old, new in zip(tree_leaves(recorded), tree_leaves(fresh), strict=True):
                    if isinstance(old, torch.Tensor) and old.untyped_storage().data_ptr() != \
                            new.untyped_storage().data_ptr():
                        old.copy_(new)
        self.replays += 1


class CPUWithGraphs:
    """The host presented as a device with graphs (recorded aten ops), no streams."""

    name = "cpu-with-recorded-graphs"

    def __init__(self) -> None:
        self.graphs: list[RecordedAtenGraph] = []

    def has(self, capability: str) -> bool:
        return capability == "graphs"

    def require(self, capability: str, hint: str = "") -> None:
        if not self.has(capability):
            raise Unsupported(self.name, capability, hint)

    def create_graph(self) -> RecordedAtenGraph:
        self.graphs.append(RecordedAtenGraph())
        return self.graphs[-1]

    def capture_to_graph(self, graph: RecordedAtenGraph, pool=None, stream=None):
        graph.given_pool = pool
        return graph.capture()

    def replay_graph(self, graph: RecordedAtenGraph) -> None:
        graph.replay()
