"""Device memory statistics of an emulated runtime, counted from the storages ops create."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors in an op's output (a tensor, or nested lists/tuples of them)."""
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


class MemoryCounters:
    """allocated / reserved / peak bytes, driven by the runtime's allocation calls."""

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.peak = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated = max(0, self.allocated - nbytes)

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def stats(self) -> dict[str, int]:
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.current": self.reserved,
        }


class AllocationTracker(TorchDispatchMode):
    """Counts, in :class:`MemoryCounters`, every new storage an op creates while it is active.

    Emulated device tensors are host tensors, so the emulated "device memory" is the set of
    storages created under the emulation: each is counted once, when it first appears as an
    op output, and released by a finalizer when it is freed. Views and in-place results reuse
    an input's storage and are not counted again.
    """

    def __init__(self, counters: MemoryCounters):
        super().__init__()
        self._counters = counters
        self._live: dict[int, int] = {}

    def _release(self, key: int) -> None:
        nbytes = self._live.pop(key, None)
        if nbytes is not None:
            self._counters.free(nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tensors_in(out):
            if t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if not key or key in self._live:
                continue
            self._live[key] = storage.nbytes()
            self._counters.allocate(storage.nbytes())
            weakref.finalize(storage, self._release, key)
        return out
