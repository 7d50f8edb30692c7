"""The part every emulated vendor torch extension shares: ``import torch_<vendor>`` installs ``torch.<device>``.

An :class:`ExtensionRuntime` holds the devices, the current device, pinned host memory and
allocation tracking that such a runtime starts with, and installs the extension module
(marked emulated, with a spec and a version) with its device module as ``torch.<device>``;
under the ``library_missing`` fault the import fails the way a missing native library makes
it fail. A plugin's runtime builds its own device module and adds what only its vendor has.
"""

from __future__ import annotations

import importlib.machinery
import types
from typing import Any, ClassVar

import torch

from .host_memory import PinnedHost
from .marker import mark_emulated
from .patching import Patcher
from .runtime import EmulatedRuntime, missing_library_error


class ExtensionRuntime(EmulatedRuntime):
    """Base of an emulated extension module ``extension`` that installs ``torch.<torch_attr>``.

    Subclasses set ``extension`` (``"torch_npu"``), ``torch_attr`` (``"npu"``), ``library`` (the
    native library a broken install lacks, ``"libhccl.so"``) and ``version``, and list the
    ``library_missing`` and ``no_device`` faults among their ``FAULTS``.
    """

    extension: ClassVar[str] = ""
    torch_attr: ClassVar[str] = ""
    library: ClassVar[str] = ""
    version: ClassVar[str] = "2.13.0+emulated"

    def __init__(self, device_count: int = 1, track_allocations: bool = True, **faults: Any):
        super().__init__(**faults)
        self.device_count = 0 if self.faults.no_device else device_count
        self.current = 0
        self.pinned_host = PinnedHost(self)
        self.track_allocations = track_allocations

    def install_missing_library(self, patcher: Patcher) -> bool:
        """Under the ``library_missing`` fault: no ``torch.<torch_attr>``, and the import fails; whether it did."""
        if not self.faults.library_missing:
            return False
        patcher.delattr(torch, self.torch_attr)
        patcher.fail_import(self.extension, missing_library_error(self.library, self.extension))
        return True

    def install_extension(self, patcher: Patcher, device_module: types.ModuleType) -> types.ModuleType:
        """Install the extension module with ``device_module`` as ``torch.<torch_attr>``; returns the extension."""
        ext = mark_emulated(types.ModuleType(self.extension))
        ext.__spec__ = importlib.machinery.ModuleSpec(self.extension, None)
        ext.__version__ = self.version
        setattr(ext, self.torch_attr, device_module)
        patcher.set_module(self.extension, ext)
        patcher.setattr(torch, self.torch_attr, device_module)
        self.pinned_host.install(patcher, self.torch_attr)
        if self.track_allocations:
            self.install_allocation_tracking(patcher)
        return ext
