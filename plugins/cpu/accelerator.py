"""What the host CPU does differently: one synchronized device, no streams, graphs or pinning.

Everything else (one device per process, program-order execution, torch's default generator)
is the base class's default for a backend whose device type is "cpu".
"""

from __future__ import annotations

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
