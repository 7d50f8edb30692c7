"""The example accelerator: the host CPU under its own name, with recorded graphs."""

from __future__ import annotations

import os

import torch
from polyaccel.accelerator import Accelerator, ProbeResult

from .graphs import RecordedGraph


class ExampleAccelerator(Accelerator):
    name = "example"
    device_type = "cpu"
    api_version = "1.0"
    #: below 0: never auto-selected (cpu is 0); users pick it by name
    priority = -10
    communication_backend = "gloo"

    def probe(self) -> ProbeResult:
        # A real plugin asks its runtime here (cheaply) and explains a "no" in words.
        return ProbeResult(True, "the host CPU, presented as the 'example' device", 1)

    def capabilities(self) -> frozenset[str]:
        return frozenset({"rng", "fp64", "bf16", "fp16", "graphs"})

    # ----------------------------------------------------------------- device
    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        if index not in (0, int(os.environ.get("LOCAL_RANK", 0))):
            raise ValueError(f"the example device has one device per process; cannot select device {index}")

    def synchronize(self, index: int | None = None) -> None:
        """Host work is complete when each call returns: nothing to wait for."""

    def is_synchronized_device(self) -> bool:
        return True

    # -------------------------------------------------------------------- RNG
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        torch.set_rng_state(state)

    def empty_cache(self) -> None:
        """The host allocator keeps no device cache."""

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
