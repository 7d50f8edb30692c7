"""The ``torch.<device>`` module functions every emulated runtime shares.

A vendor extension's device module (what ``torch.get_device_module(device_type)`` returns)
answers device count and selection, synchronisation, RNG, memory statistics, streams and
events. :class:`DeviceModuleFunctions` answers them for one emulated runtime; a runtime
puts them on its stand-in module with :meth:`DeviceModuleFunctions.install` and adds what
is its own.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch

from .streams import EmulatedEvent, EmulatedStream

if TYPE_CHECKING:
    from .runtime import EmulatedRuntime


def device_index(device: Any) -> int | None:
    """The index in ``3``, ``"dev:3"``, ``torch.device("dev", 3)``; None for "current"."""
    if device is None or isinstance(device, int):
        return device
    if isinstance(device, str):
        return int(device.split(":")[1]) if ":" in device else None
    return getattr(device, "index", None)


class DeviceModuleFunctions:
    """The shared ``torch.<device>`` functions, bound to ``rt``.

    ``rt`` needs ``device_count`` and ``current``; ``invalid_device`` is the runtime's own
    message for a bad ordinal (``{device}`` and ``{count}`` are filled in). The emulated device
    *is* the host, so the device RNG functions act on torch's default (host) generator.
    """

    NAMES = (
        "is_available", "device_count", "current_device", "set_device", "synchronize", "manual_seed",
        "manual_seed_all", "initial_seed", "get_rng_state", "set_rng_state", "memory_allocated",
        "max_memory_allocated", "memory_reserved", "reset_peak_memory_stats", "memory_stats", "empty_cache",
        "mem_get_info", "get_device_name", "Stream", "Event", "current_stream", "default_stream", "stream",
    )

    def __init__(self, rt: EmulatedRuntime, *, device_name: str, invalid_device: str,
                 total_memory: int = 64 * 2**30):
        self._rt = rt
        self._device_name = device_name
        self._invalid_device = invalid_device
        self._total_memory = total_memory

    def install(self, module: types.ModuleType) -> None:
        for name in self.NAMES:
            setattr(module, name, getattr(self, name))

    # ------------------------------------------------------------------ devices
    def is_available(self) -> bool:
        self._rt.record("is_available")
        return self._rt.device_count > 0

    def device_count(self) -> int:
        return self._rt.device_count

    def current_device(self) -> int:
        return self._rt.current

    def set_device(self, device) -> None:
        idx = device_index(device)
        if idx is None or not 0 <= idx < self._rt.device_count:
            raise RuntimeError(self._invalid_device.format(device=repr(device), count=self._rt.device_count))
        self._rt.record("set_device", idx)
        self._rt.current = idx

    def synchronize(self, device=None) -> None:
        self._rt.record("synchronize", device_index(device))
        self._rt.synchronize_all()

    def get_device_name(self, device=None) -> str:
        return self._device_name

    # ---------------------------------------------------------------------- RNG
    def manual_seed(self, seed: int) -> None:
        self._rt.record("manual_seed", int(seed))
        torch.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        self._rt.record("manual_seed_all", int(seed))
        torch.manual_seed(int(seed))

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(new_state)

    # ------------------------------------------------------------------- memory
    def memory_allocated(self, device=None) -> int:
        return self._rt.memory.allocated

    def max_memory_allocated(self, device=None) -> int:
        return self._rt.memory.peak

    def memory_reserved(self, device=None) -> int:
        return self._rt.memory.reserved

    def reset_peak_memory_stats(self, device=None) -> None:
        self._rt.memory.reset_peak()

    def memory_stats(self, device=None) -> dict:
        return self._rt.memory.stats()

    def empty_cache(self) -> None:
        self._rt.record("empty_cache")
        self._rt.memory.empty_cache()

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self._total_memory - self._rt.memory.reserved, self._total_memory

    # --------------------------------------------------------- streams, events
    def Stream(self, device=None, priority: int = 0, **kwargs) -> EmulatedStream:  # noqa: N802 - torch's name
        return EmulatedStream(self._rt, device, priority)

    def Event(self, enable_timing: bool = False, blocking: bool = False,  # noqa: N802 - torch's name
              interprocess: bool = False) -> EmulatedEvent:
        return EmulatedEvent(self._rt, enable_timing, blocking, interprocess)

    def current_stream(self, device=None) -> EmulatedStream:
        return self._rt.current_stream()

    def default_stream(self, device=None) -> EmulatedStream:
        return self._rt.default_stream()

    def stream(self, s):
        return self._rt.use_stream(s)
