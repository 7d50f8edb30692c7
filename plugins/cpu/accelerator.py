"""What the host CPU does differently: one synchronized device, no streams, graphs or pinning."""

from __future__ import annotations

import os

import torch
from polyaccel.accelerator import Accelerator, ProbeResult


class CpuAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    priority = 0
    communication_backend = "gloo"

    def probe(self) -> ProbeResult:
        return ProbeResult(True, "", 1)

    def capabilities(self) -> frozenset[str]:
        caps = {"rng", "fp64", "bf16"}
        if torch.backends.mkldnn.is_available():
            caps.add("fp16")
        return frozenset(caps)

    # one logical device per process; LOCAL_RANK does not address different hardware
    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        if index not in (0, int(os.environ.get("LOCAL_RANK", 0))):
            raise ValueError(f"cpu has a single device per process; cannot select device {index}")

    def synchronize(self, index: int | None = None) -> None:
        """Work on the host is complete when the call returns."""

    def is_synchronized_device(self) -> bool:
        return True

    def resolves_data_dependency(self) -> bool:
        return True

    def handles_memory_backpressure(self) -> bool:
        return True

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
