"""The example accelerator: the host CPU under its own name, with recorded graphs.

Its tensors are host tensors, so it derives from ``HostAccelerator``, whose host defaults
serve it: one device per process, program-order execution (``synchronize`` has nothing to
wait for), and torch's default generator for the ``rng`` capability. It defines only its
identity, its probe (which asks the vendor runtime when one is installed), what it claims,
and what backs the one capability the host cannot provide by itself: graphs.
"""

from __future__ import annotations

from polyaccel.accelerator import ProbeResult
from polyaccel.host_accelerator import HostAccelerator

from . import runtime
from .graphs import RecordedGraph


class ExampleAccelerator(HostAccelerator):
    name = "example"
    api_version = "1.2"
    #: below 0: never auto-selected (cpu is 0); users pick it by name
    priority = -10

    def probe(self) -> ProbeResult:
        # Ask the runtime (cheaply) and explain a "no" in words.
        rt = runtime.find_runtime()
        if rt is None:
            return ProbeResult(True, "the host CPU, presented as the 'example' device", 1)
        count = int(rt.device_count())
        if count < 1:
            return ProbeResult(False, f"the example runtime {rt.__version__} sees no device (check that the "
                                      "board is powered and visible to this process)")
        return ProbeResult(True, f"example runtime {rt.__version__}: {count} device(s)", count)

    def capabilities(self) -> frozenset[str]:
        return frozenset({"rng", "fp64", "bf16", "fp16", "graphs"})

    def report_facts(self) -> dict:
        """What ``polyaccel report`` shows under "example"."""
        from polyaccel import selection

        return {"graphs": "recorded op replay on the host", "selected": selection.selected_or_none() is self}

    # ----------------------------------------------------------------- graphs
    def create_graph(self) -> RecordedGraph:
        self.require("graphs")
        return RecordedGraph()

    def capture_to_graph(self, graph: RecordedGraph, pool=None, stream=None):
        self.require("graphs")
        if not isinstance(graph, RecordedGraph):
            raise TypeError(f"capture_to_graph needs a graph from create_graph(), got {type(graph).__name__}")
        return graph.capture()

    def replay_graph(self, graph: RecordedGraph) -> None:
        self.require("graphs")
        graph.replay()
