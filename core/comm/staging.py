"""Host staging for backends that cannot read device memory (gloo with mps tensors).

A staged call copies each input into a host buffer obtained from the accelerator
(``empty_pinned``: pinned, else registered, else plain), runs the collective
asynchronously on the host buffers and copies results back into the caller's tensors
only inside the handle's ``wait()``, after the transfer completed. Tensors a call only
reads (the payload of a send, the source of a broadcast) are never copied back. Buffers
return to a pool keyed by (dtype, element count) when the handle completes, so a steady
training loop allocates nothing after its first step.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .handles import CommHandle

#: how a call uses a tensor: read only, written only, or both
IN, OUT, INOUT = "in", "out", "inout"


@dataclass
class StagingStats:
    """Counters tests and benchmarks read to prove the staging contract."""

    staged_calls: int = 0
    allocations: int = 0
    reuses: int = 0
    copies_in: int = 0
    copies_back: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class StagingPool:
    """Reusable host buffers, one free list per (dtype, numel)."""

    def __init__(self, accelerator):
        self._accelerator = accelerator
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.stats = StagingStats()

    def acquire(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get((dtype, numel))
            if free:
                self.stats.reuses += 1
                return free.pop()
            self.stats.allocations += 1
        return self._accelerator.empty_pinned((numel,), dtype)

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free[(buffer.dtype, buffer.numel())].append(buffer)

    def free_buffers(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._free.values())

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def run_staged(op: str, entries: Sequence[tuple[torch.Tensor, str]], launch: Callable, *, pool: StagingPool,
               needs_staging: Callable[[torch.Tensor], bool], accelerator, timeout_s: float | None) -> CommHandle:
    """Run ``launch(tensors, async_op=True)`` with staged stand-ins for the tensors that need them.

    ``entries`` pairs each tensor of the call with its role (:data:`IN`, :data:`OUT`,
    :data:`INOUT`); ``launch`` receives the tensors to use, in the same order.
    """
    actual: list[torch.Tensor] = []
    held: list[torch.Tensor] = []
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    device_sources = False
    for tensor, role in entries:
        if not needs_staging(tensor):
            actual.append(tensor)
            continue
        flat = pool.acquire(tensor.dtype, tensor.numel())
        held.append(flat)
        host = flat.view(tensor.shape)
        if role != OUT:
            host.copy_(tensor, non_blocking=True)
            pool.stats.copies_in += 1
            device_sources = device_sources or tensor.device.type != "cpu"
        if role != IN:
            copy_back.append((tensor, host))
        actual.append(host)
    if device_sources:
        # the device->host copies were queued asynchronously; the host backend reads the buffers next
        accelerator.synchronize()
    pool.stats.staged_calls += 1
    try:
        work = launch(actual, True)
    except BaseException:
        for flat in held:
            pool.release(flat)
        raise

    def finalize() -> None:
        for tensor, host in copy_back:
            # a blocking copy: the buffer goes back to the pool next, and an async host->device copy
            # could still be reading it when the next staged call overwrites it
            tensor.copy_(host)
            pool.stats.copies_back += 1
        for flat in held:
            pool.release(flat)

    return CommHandle(op, [work], finalize, timeout_s)
