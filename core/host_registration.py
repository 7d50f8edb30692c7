"""Pinned and registered host memory: the accelerator's methods for it and their bookkeeping.

:class:`HostMemory` holds the contract's host-memory methods (a base of
:class:`polyaccel.accelerator.Accelerator`; a plugin overrides them on its accelerator). Registering
an existing host buffer with the device runtime (no copy) goes through one :class:`HostRegistrations`
table per accelerator: a buffer registered twice is counted, and the runtime sees one registration
until the last release. A buffer whose unregistration the runtime refused stays registered, so the
device may still write into it: it is kept referenced in :data:`LEAKED_HOST_BUFFERS`, never freed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from .errors import PolyaccelError, Unsupported


class HostRegistration:
    """One registered buffer: the range the runtime was given and how many holders it has."""

    __slots__ = ("ptr", "nbytes", "count", "tensor", "leaked")

    def __init__(self, ptr: int, nbytes: int, tensor: torch.Tensor):
        self.ptr = ptr
        self.nbytes = nbytes
        self.count = 1
        self.tensor = tensor
        self.leaked = False


#: Buffers whose unregistration failed: kept referenced so the memory is never freed.
LEAKED_HOST_BUFFERS: list[HostRegistration] = []


def aligned_range(tensor: torch.Tensor, align: int) -> tuple[int, int]:
    """(address, length) covering ``tensor``'s bytes to the end of its storage, rounded out to ``align``."""
    start = tensor.data_ptr()
    end = start + tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    end = max(end, start + tensor.numel() * tensor.element_size())
    lo = start - start % align
    hi = -(-end // align) * align
    return lo, hi - lo


class HostRegistrations:
    """The refcounted table of one accelerator's registered host buffers, keyed by data pointer."""

    def __init__(self, owner: str):
        self.owner = owner
        self._regs: dict[int, HostRegistration] = {}
        self._lock = threading.Lock()

    def __contains__(self, ptr: int) -> bool:
        return ptr in self._regs

    def counts(self) -> dict[int, int]:
        """Registered buffers: data pointer -> reference count."""
        return {k: r.count for k, r in self._regs.items()}

    def register(self, tensor: torch.Tensor, range_of: Callable[[torch.Tensor], tuple[int, int]],
                 register: Callable[[int, int], None]) -> None:
        """Count one more holder of ``tensor``; the first one calls ``register(*range_of(tensor))``."""
        if tensor.device.type != "cpu":
            raise PolyaccelError(
                f"register_host_memory needs a host (cpu) tensor, got one on {tensor.device}")
        if not tensor.is_contiguous():
            raise PolyaccelError("register_host_memory needs a contiguous tensor; call .contiguous() first")
        if tensor.numel() == 0:
            return
        with self._lock:
            key = tensor.data_ptr()
            reg = self._regs.get(key)
            if reg is not None:
                reg.count += 1
                return
            ptr, nbytes = range_of(tensor)
            register(ptr, nbytes)
            self._regs[key] = HostRegistration(ptr, nbytes, tensor)

    def unregister(self, tensor: torch.Tensor, unregister: Callable[[int], None]) -> bool:
        """Drop one holder; the last calls ``unregister(ptr)``. True when the runtime was told.

        If ``unregister`` raises, the buffer goes to :data:`LEAKED_HOST_BUFFERS` (never freed)
        and the error propagates.
        """
        if tensor.numel() == 0:
            return False
        with self._lock:
            reg = self._regs.get(tensor.data_ptr())
            if reg is None:
                raise PolyaccelError(
                    f"unregister_host_memory: buffer at {tensor.data_ptr():#x} was not registered "
                    f"with {self.owner!r}"
                )
            reg.count -= 1
            if reg.count > 0:
                return False
            del self._regs[tensor.data_ptr()]
            try:
                unregister(reg.ptr)
            except Exception:
                reg.leaked = True
                LEAKED_HOST_BUFFERS.append(reg)
                raise
        return True


class HostMemory:
    """The accelerator's pinned and registered host memory ("pinned", "host_register").

    A device with registration implements :meth:`_host_register`, :meth:`_host_unregister` and
    :meth:`pin_memory_alignment`; the range rounding, reference counts and failures are handled here.
    Part of :class:`~polyaccel.accelerator.Accelerator` (which creates ``_host_memory`` and provides
    ``require``, ``capabilities`` and ``name``).
    """

    _host_memory: HostRegistrations

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of a host tensor (the tensor itself if already pinned). Guarded by "pinned".

        Pins for torch's current accelerator, which is this backend's device once its runtime is
        loaded (torch serves one accelerator per process; the device argument is deprecated).
        """
        self.require("pinned")
        if tensor.device.type != "cpu":
            raise PolyaccelError(f"pin_memory needs a host (cpu) tensor, got one on {tensor.device}")
        return tensor if self.is_pinned(tensor) else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Registered with this accelerator, or pinned where "pinned" is claimed."""
        if tensor.device.type != "cpu":
            return False
        if tensor.data_ptr() in self._host_memory:
            return True
        return "pinned" in self.capabilities() and tensor.is_pinned()

    def empty_pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for fast DMA: pinned where "pinned" is claimed, else plain."""
        buf = torch.empty(shape, dtype=dtype)
        return self.pin_memory(buf) if "pinned" in self.capabilities() else buf

    def pin_memory_alignment(self) -> int:
        """Byte alignment host registration needs; the registered range is rounded to it."""
        return 1

    def _host_register(self, ptr: int, nbytes: int) -> None:
        """Backend hook: register [ptr, ptr+nbytes) with the device runtime; raise on failure."""
        raise Unsupported(self.name, "host_register")

    def _host_unregister(self, ptr: int) -> None:
        """Backend hook: undo :meth:`_host_register`; raise on failure."""
        raise Unsupported(self.name, "host_register")

    def host_register_range(self, tensor: torch.Tensor) -> tuple[int, int]:
        """The (address, length) actually registered for ``tensor``: rounded to the alignment."""
        return aligned_range(tensor, self.pin_memory_alignment())

    def register_host_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Register an existing host buffer for DMA in place (no copy). Guarded by "host_register".

        Refcounted (:class:`HostRegistrations`): the runtime sees one registration
        through :meth:`_host_register` until the last :meth:`unregister_host_memory`.
        """
        self.require("host_register")
        self._host_memory.register(tensor, self.host_register_range, self._host_register)
        return tensor

    def unregister_host_memory(self, tensor: torch.Tensor) -> bool:
        """Drop one reference; the last calls :meth:`_host_unregister`. True when the runtime was told.

        A refused unregistration keeps the buffer referenced forever (leaked, never freed): the
        device may still DMA into it.
        """
        self.require("host_register")
        return self._host_memory.unregister(tensor, self._host_unregister)

    def host_registrations(self) -> dict[int, int]:
        """Registered buffers: data pointer -> reference count."""
        return self._host_memory.counts()
