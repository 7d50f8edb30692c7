"""Host buffers for offloaded optimizer state and parameters, through the accelerator contract.

Buffers come from the selected accelerator: page-locked allocations (``empty_pinned``) when
it claims ``pinned``, else ordinary host memory registered in place with the device runtime
(``register_host_memory``) when it claims ``host_register``, else plain host memory (the
cpu plugin, where host memory *is* device memory). Nothing here calls
``torch.Tensor.pin_memory`` directly.
"""

from __future__ import annotations

import torch


class HostBuffers:
    def __init__(self, accelerator, pin: bool = True):
        self.accelerator = accelerator
        self.pin = pin
        self._registered: list[torch.Tensor] = []

    @property
    def how(self) -> str:
        """How buffers are made fast to copy: "pinned", "registered" or "pageable"."""
        if not self.pin:
            return "pageable"
        if self.accelerator.has("pinned"):
            return "pinned"
        if self.accelerator.has("host_register"):
            return "registered"
        return "pageable"

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        how = self.how
        if how == "pinned":
            return self.accelerator.empty_pinned((numel,), dtype)
        buf = torch.empty(numel, dtype=dtype)
        if how == "registered" and numel:
            self.accelerator.register_host_memory(buf)
            self._registered.append(buf)
        return buf

    def release(self) -> None:
        """Unregister what was registered (a refused unregister leaks rather than frees)."""
        while self._registered:
            self.accelerator.unregister_host_memory(self._registered.pop())
