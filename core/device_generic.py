"""How :class:`polyaccel.accelerator.Accelerator`'s defaults reach torch without naming a device.

Each default asks the accelerator's device module (``torch.get_device_module(device_type)``,
through ``acc._device_module()``) first: its functions are the ones its streams, events and
emulated stand-ins agree with. What the module lacks comes from ``torch.accelerator`` (and
``torch.Stream`` / ``torch.Event`` / ``torch.accelerator.Graph``), but only where torch's
accelerator is this device type (``acc._torch_accelerator_serves()``): torch drives one
accelerator per process. Neither having it is :class:`polyaccel.Unsupported`, never another
backend's function.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .errors import Unsupported

#: the accelerator whose default asks (typed loosely: polyaccel.accelerator imports this module)
Accelerator = Any


def missing(acc: Accelerator, name: str, generic: str) -> Unsupported:
    return Unsupported(acc.name, f"torch.{acc.device_type}.{name}",
                       f"torch {torch.__version__} has neither it nor {generic} for device type "
                       f"{acc.device_type!r}; the plugin must implement it")


def device_function(acc: Accelerator, name: str, generic: str | None = None, required: bool = True):
    """The device module's ``name``, else ``torch.accelerator.<generic or name>`` where it serves ``acc``.

    Neither having it raises :class:`Unsupported` (returns None when not ``required``).
    """
    fn = getattr(acc._device_module(required=False), name, None)
    if fn is None and acc._torch_accelerator_serves():
        fn = getattr(torch.accelerator, generic or name, None)
    if fn is None and required:
        raise missing(acc, name, f"torch.accelerator.{generic or name}")
    return fn


def device_index(current: Any) -> int:
    """An index from what a torch device module's ``current_device()`` returns (int, str or device)."""
    if isinstance(current, bool):
        raise TypeError(f"current_device() returned {current!r}, not a device index")
    if isinstance(current, int):
        return current
    if isinstance(current, (str, torch.device)):
        index = torch.device(current).index
        return 0 if index is None else int(index)
    return int(current)


# Streams and events: the device module's classes where it has them, torch.Stream/torch.Event where
# it has none. torch.cuda.Stream compares unequal to a torch.Stream of the same queue, so the streams
# of one backend must all come from one family.
def new_stream(acc: Accelerator, device=None, **kwargs):
    cls = getattr(acc._device_module(required=False), "Stream", None)
    if cls is not None:
        return cls(device, **kwargs)
    if not acc._torch_accelerator_serves():
        raise missing(acc, "Stream", "torch.Stream")
    index = device if device is None or isinstance(device, int) else torch.device(device).index
    return torch.Stream(torch.device(acc.device_type, index), **kwargs)


def new_event(acc: Accelerator, **kwargs):
    cls = getattr(acc._device_module(required=False), "Event", None)
    if cls is not None:
        return cls(**kwargs)
    if not acc._torch_accelerator_serves():
        raise missing(acc, "Event", "torch.Event")
    return torch.Event(acc.device_type, **kwargs)


def stream_context(acc: Accelerator, stream):
    switch = getattr(acc._device_module(required=False), "stream", None)
    if switch is None and isinstance(stream, torch.Stream):
        return stream  # a torch.Stream is its own context manager
    return (switch or device_function(acc, "stream"))(stream)


# Graphs: the device module's ``graph_class`` where the plugin names one; else torch.accelerator.Graph,
# only where torch's accelerator is this device type; everywhere else Unsupported.
def require_graphs(acc: Accelerator) -> None:
    if acc.graph_class:
        acc.require("graphs", f"torch.{acc.device_type} has no {acc.graph_class}; use eager execution")
        return
    acc.require("graphs", "use eager execution; this backend has no device graphs")
    if not (hasattr(torch.accelerator, "Graph") and acc._torch_accelerator_serves()):
        raise Unsupported(acc.name, "graphs",
                          f"torch {torch.__version__} has no device-generic graph (torch.accelerator.Graph) "
                          f"for device type {acc.device_type!r}; the plugin must name its graph_class or "
                          "implement create_graph, capture_to_graph and replay_graph")


def new_graph(acc: Accelerator):
    if acc.graph_class:
        return getattr(acc._device_module(), acc.graph_class)()
    return torch.accelerator.Graph()


def capture(acc: Accelerator, graph, pool=None, stream=None):
    """The module's ``graph(graph, pool=, stream=)``, else ``graph`` entered on ``stream`` (by default a
    new side stream: runtimes refuse to capture the default stream)."""
    if acc.graph_class:
        return acc._device_module().graph(graph, pool=pool, stream=stream)
    if pool is not None:
        graph.graph_pool = pool
    return _capturing(graph, acc.stream(acc.Stream() if stream is None else stream))


@contextlib.contextmanager
def _capturing(graph, stream_context):
    with stream_context, graph:
        yield graph
