"""Host "graphs": record the torch calls made during capture, re-run them on replay.

Like a device graph, a recorded graph is bound to the tensors it was captured with
(the static inputs and outputs): replay re-executes every op on the current contents
of the inputs and writes the results into the same output tensors. Python control
flow and host values read during capture (``.item()``) are frozen at capture time.

Recording uses a ``TorchFunctionMode`` (torch's public hook on every torch call), which
costs nothing to enter; a ``TorchDispatchMode`` would see aten ops but its first use
imports torch's compiler stack (seconds).
"""

from __future__ import annotations

import contextlib

import torch
from polyaccel.errors import PolyaccelError
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class _Recorder(TorchFunctionMode):
    def __init__(self, ops: list) -> None:
        super().__init__()
        self._ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._ops.append((func, args, kwargs, out))
        return out


class RecordedGraph:
    def __init__(self) -> None:
        self._ops: list | None = None

    @property
    def captured(self) -> bool:
        return self._ops is not None

    @contextlib.contextmanager
    def capture(self):
        """Run the block eagerly while recording it; the outputs it creates are the static outputs."""
        if self._ops is not None:
            raise PolyaccelError("this graph was already captured; create a new graph to capture again")
        ops: list = []
        with _Recorder(ops):
            yield self
        self._ops = ops

    def replay(self) -> None:
        if self._ops is None:
            raise PolyaccelError("replay of a graph that was never captured: capture it with "
                                 "capture_to_graph() before replay_graph()")
        for func, args, kwargs, captured in self._ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_leaves(captured), tree_leaves(fresh), strict=True):
                if isinstance(old, torch.Tensor) and old is not new:
                    old.copy_(new)
