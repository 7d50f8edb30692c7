"""The host's accelerator: a backend whose tensors are host (``cpu``) tensors.

:class:`HostAccelerator` gives such a backend the host's answers where the device-generic
defaults of :class:`polyaccel.accelerator.Accelerator` would ask a device runtime: one device
per process, work complete when each call returns, and torch's default generator for RNG
(``torch.cpu`` has none). The cpu plugin and a vendor's host-backed plugin (the example plugin,
a runtime reached through host tensors) derive from it and add their identity and
:meth:`~HostAccelerator.probe`; see docs/plugin-authoring.md, "Host-backed plugins".
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from .accelerator import Accelerator
from .errors import InvalidArgument


class HostAccelerator(Accelerator):
    """Base of accelerators whose device is the host: one synchronized device per process."""

    device_type: ClassVar[str] = "cpu"
    communication_backend: ClassVar[str] = "gloo"

    # ------------------------------------------------------------------ device
    def device(self, index: int | None = None) -> torch.device:
        """The host, whatever ``index`` says (``set_device`` refuses indexes it cannot serve)."""
        return torch.device(self.device_type)

    def device_count(self) -> int:
        """The host is one device per process."""
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        """Accept 0 and this process's LOCAL_RANK (one host device per rank); refuse any other index."""
        if index not in (0, int(os.environ.get("LOCAL_RANK", 0))):
            raise InvalidArgument(
                f"{self.name} has one host device per process; cannot select device {index}")

    def synchronize(self, index: int | None = None) -> None:
        """Host work is complete when each call returns: nothing to wait for."""

    def empty_cache(self) -> None:
        """The host keeps no device cache: nothing to release."""

    # --------------------------------------------------------- execution model
    def is_synchronized_device(self) -> bool:
        return True

    def resolves_data_dependency(self) -> bool:
        return True

    def handles_memory_backpressure(self) -> bool:
        return True

    # --------------------------------------------------------------------- RNG
    # Guarded by "rng", like the base's: torch's default generator is the host's.
    def manual_seed(self, seed: int) -> None:
        self.require("rng")
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.require("rng")
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        self.require("rng")
        return int(torch.initial_seed())

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        self.require("rng")
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        self.require("rng")
        torch.set_rng_state(state)


def with_host_defaults(cls: type[Accelerator]) -> type[Accelerator]:
    """``cls``, or, for a host-backed class derived from :class:`Accelerator` alone, ``cls`` over the host's.

    Contract 1.0/1.1 plugins got the host's answers from :class:`Accelerator` itself whenever their
    ``device_type`` was the host's. Discovery passes each plugin's classes through here so they keep
    them: the class returned derives from ``cls`` first (its own methods win), then :class:`HostAccelerator`.
    """
    if cls.device_type != HostAccelerator.device_type or issubclass(cls, HostAccelerator):
        return cls
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    return type(cls.__name__, (cls, HostAccelerator), namespace)
