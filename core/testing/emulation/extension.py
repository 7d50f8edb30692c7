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

from ...vendor_extension import VendorExtension
from .device_module import DeviceModuleFunctions
from .graphs import EmulatedGraph, install_graph_api
from .host_memory import HostMemoryTable, PinnedHost
from .marker import mark_emulated
from .patching import Patcher
from .runtime import EmulatedRuntime, missing_library_error


class RuntimeBinding:
    """The runtime-API object an extension hands out (``torch.npu.npurt()``), with host registration.

    ``table`` keeps the registered ranges and answers with the vendor's return codes; subclasses
    add the vendor's functions (``npuHostRegister`` ...) and record them in ``runtime``'s call log.
    """

    def __init__(self, runtime: EmulatedRuntime, table: HostMemoryTable):
        self._rt = runtime
        self._table = table
        mark_emulated(self)

    @property
    def registered(self) -> dict[int, tuple[int, int]]:
        """Registered ranges: address -> (length, flags)."""
        return dict(self._table.ranges)


class ExtensionRuntime(EmulatedRuntime):
    """Base of an emulated vendor extension module that installs ``torch.<device>``.

    Subclasses set ``vendor`` (the plugin's :class:`~polyaccel.vendor_extension.VendorExtension`:
    ``torch_npu`` installing ``torch.npu``), ``library`` (the native library a broken install
    lacks, ``"libhccl.so"``), ``version`` if not the default, the device module's
    ``device_name``, ``invalid_device`` message and ``graph_class``, and list the
    ``library_missing``, ``no_device`` and ``no_graphs`` faults among their ``FAULTS``.
    """

    #: the extension the plugin probes: its module and the ``torch`` attribute it installs
    vendor: ClassVar[VendorExtension]
    library: ClassVar[str] = ""
    version: ClassVar[str] = "2.13.0+emulated"
    device_name: ClassVar[str] = ""
    #: :class:`DeviceModuleFunctions`' message for a bad device index (``{device}``, ``{count}``)
    invalid_device: ClassVar[str] = ""
    graph_class: ClassVar[type[EmulatedGraph]] = EmulatedGraph

    @property
    def extension(self) -> str:
        return self.vendor.module

    @property
    def torch_attr(self) -> str:
        return self.vendor.torch_attr

    def __init__(self, device_count: int = 1, track_allocations: bool = True, **faults: Any):
        super().__init__(**faults)
        self.device_count = 0 if self.faults.no_device else device_count
        self.current = 0
        self.pinned_host = PinnedHost(self)
        self.track_allocations = track_allocations
        self.graphs: list[EmulatedGraph] = []

    def build_device_module(self) -> types.ModuleType:
        """``torch.<torch_attr>``: the functions every device module has, and the graph API unless ``no_graphs``."""
        module = mark_emulated(types.ModuleType(f"{self.extension}.{self.torch_attr}"))
        DeviceModuleFunctions(self, device_name=self.device_name, invalid_device=self.invalid_device).install(module)
        if not self.faults.no_graphs:
            install_graph_api(module, self, self.graph_class)
        return module

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
