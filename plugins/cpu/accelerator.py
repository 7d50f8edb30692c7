"""What the host CPU claims: one synchronized device, no streams, graphs or pinning.

Everything else (one device per process, program-order execution, torch's default generator)
comes from :class:`polyaccel.host_accelerator.HostAccelerator`.
"""

from __future__ import annotations

import torch
from polyaccel.accelerator import ProbeResult
from polyaccel.host_accelerator import HostAccelerator


class CpuAccelerator(HostAccelerator):
    name = "cpu"
    priority = 0

    def probe(self) -> ProbeResult:
        return ProbeResult(True, "", 1)

    def capabilities(self) -> frozenset[str]:
        caps = {"rng", "fp64", "bf16"}
        if torch.backends.mkldnn.is_available():
            caps.add("fp16")
        return frozenset(caps)
