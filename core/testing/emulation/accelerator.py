"""What changes for a plugin's accelerator while its runtime is emulated.

An emulated runtime keeps every tensor on the host, so the accelerator it stands in for
must place tensors there, count host tensors as its own, and say it is emulated. The
production class knows nothing of this: while an :class:`~.runtime.EmulatedRuntime` whose
``accelerator`` names the class is active, :func:`emulate_accelerator` patches these
methods onto that class (through the runtime's :class:`~.patching.Patcher`, so they are
undone on exit).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from polyaccel.accelerator import Accelerator, ProbeResult

    from .patching import Patcher

HOST = torch.device("cpu")


def _is_emulated(self: Accelerator) -> bool:
    return True


def _device(self: Accelerator, index: int | None = None) -> torch.device:
    return HOST


def _on_accelerator(self: Accelerator, tensor: torch.Tensor) -> bool:
    return tensor.device.type == HOST.type


def emulate_accelerator(patcher: Patcher, cls: type[Accelerator]) -> None:
    """Make ``cls`` an emulated accelerator until ``patcher`` restores it.

    ``device()`` is the host, host tensors are its tensors (``on_accelerator``; so a backend
    that cannot read device tensors stages them, and the staging path runs on the CPU),
    ``is_emulated()`` is True and every ``probe()`` result says ``emulated``.
    """
    real_probe = cls.probe

    def probe(self: Accelerator) -> ProbeResult:
        return dataclasses.replace(real_probe(self), emulated=True)

    patcher.setattr(cls, "probe", probe)
    patcher.setattr(cls, "is_emulated", _is_emulated)
    patcher.setattr(cls, "device", _device)
    patcher.setattr(cls, "on_accelerator", _on_accelerator)
