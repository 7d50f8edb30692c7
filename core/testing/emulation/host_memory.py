"""Host memory as a device runtime sees it: registered ranges, and its page-locked allocator."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .patching import Patcher
    from .runtime import EmulatedRuntime


class HostMemoryTable:
    """Registered host ranges as a runtime keeps them, with integer status codes.

    ``register`` checks alignment (address and length multiples of ``alignment``), flags
    and overlap; the codes are the runtime's own (given by the subclassing runtime).
    """

    def __init__(self, alignment: int, ok: int = 0, invalid_value: int = 1, already_registered: int = 2,
                 not_registered: int = 3):
        self.alignment = alignment
        self.ok = ok
        self.invalid_value = invalid_value
        self.already_registered = already_registered
        self.not_registered = not_registered
        self.ranges: dict[int, tuple[int, int]] = {}  # ptr -> (nbytes, flags)

    def register(self, ptr: int, nbytes: int, flags: int, allowed_flags: tuple[int, ...]) -> int:
        if ptr <= 0 or nbytes <= 0 or ptr % self.alignment or nbytes % self.alignment:
            return self.invalid_value
        if flags not in allowed_flags:
            return self.invalid_value
        for p, (n, _) in self.ranges.items():
            if ptr < p + n and p < ptr + nbytes:
                return self.already_registered
        self.ranges[ptr] = (nbytes, flags)
        return self.ok

    def unregister(self, ptr: int) -> int:
        if ptr not in self.ranges:
            return self.not_registered
        del self.ranges[ptr]
        return self.ok

    def covers(self, ptr: int, nbytes: int) -> bool:
        return any(p <= ptr and ptr + nbytes <= p + n for p, (n, _) in self.ranges.items())


class PinnedHost:
    """A runtime's page-locked host allocator, emulated: pinning returns a tracked copy."""

    def __init__(self, runtime: EmulatedRuntime):
        self._rt = runtime
        self._pinned: dict[int, weakref.ref] = {}

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":
            raise RuntimeError(f"cannot pin '{tensor.device}' memory: only dense CPU tensors can be pinned")
        self._rt.record("pin_memory", tensor.numel() * tensor.element_size())
        out = tensor.clone(memory_format=torch.contiguous_format)
        self._pinned[out.untyped_storage().data_ptr()] = weakref.ref(out.untyped_storage())
        return out

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        ref = self._pinned.get(tensor.untyped_storage().data_ptr()) if tensor.device.type == "cpu" else None
        return ref is not None and ref() is not None

    def install(self, patcher: Patcher, device_type: str) -> None:
        """Route ``Tensor.pin_memory()`` / ``is_pinned()`` (no device, or ``device_type``) here.

        With the vendor extension loaded, the machine's accelerator *is* that device, so a
        plain ``pin_memory()`` pins for it.
        """
        real_pin, real_is_pinned = torch.Tensor.pin_memory, torch.Tensor.is_pinned

        def ours(args, kwargs) -> bool:
            dev = kwargs.get("device", args[0] if args else None)
            return dev is None or str(dev).split(":")[0] == device_type

        def pin_memory(tensor, *args, **kwargs):
            return self.pin(tensor) if ours(args, kwargs) else real_pin(tensor, *args, **kwargs)

        def is_pinned(tensor, *args, **kwargs):
            return self.is_pinned(tensor) if ours(args, kwargs) else real_is_pinned(tensor, *args, **kwargs)

        patcher.setattr(torch.Tensor, "pin_memory", pin_memory)
        patcher.setattr(torch.Tensor, "is_pinned", is_pinned)
