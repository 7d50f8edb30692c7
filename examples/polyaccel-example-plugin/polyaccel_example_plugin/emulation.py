"""The example's emulated runtime: a stand-in for its vendor runtime, for tests on any machine.

What a plugin ships so that ``polyaccel conformance --accelerator example --emulate`` and
its tests run where the device is missing: an :class:`~polyaccel.testing.emulation.EmulatedRuntime`
subclass offered through the ``polyaccel_emulated_runtimes`` hook (see ``__init__.py``).
``install`` puts a stand-in for the vendor runtime module into ``sys.modules`` through the
patcher (undone on exit); the kit records every call in ``runtime.calls``, checks the fault
switches and keeps the example accelerator's tensors on the host while it is active.
"""

from __future__ import annotations

import types
from typing import Any

from polyaccel.testing.emulation import EmulatedRuntime, Patcher, mark_emulated

from .accelerator import ExampleAccelerator
from .runtime import RUNTIME_MODULE


class ExampleRuntime(EmulatedRuntime):
    name = "example"
    accelerator = ExampleAccelerator
    FAULTS = {"no_device": "the runtime answers but sees no device: the accelerator is unavailable, with the reason"}

    def __init__(self, device_count: int = 1, **faults: Any):
        super().__init__(**faults)
        self.device_count = 0 if self.faults.no_device else device_count

    def install(self, patcher: Patcher) -> None:
        module = mark_emulated(types.ModuleType(RUNTIME_MODULE))
        module.__version__ = "1.0+emulated"
        module.device_count = self._device_count
        patcher.set_module(RUNTIME_MODULE, module)

    def _device_count(self) -> int:
        self.record("device_count", result=self.device_count)
        return self.device_count
