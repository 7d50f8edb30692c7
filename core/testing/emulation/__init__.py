"""A kit for CPU-backed stand-ins of vendor runtimes, so CI exercises every plugin code path.

Each plugin ships its runtime (an :class:`EmulatedRuntime` subclass) through the ``polyaccel_emulated_runtimes``
hook; ``with emulate("example", device_count=2) as runtime:`` installs it (fake modules, attributes on torch),
resets selection so the plugin's probe sees it, records every call in ``runtime.calls`` and takes fault
switches as keyword arguments. It proves a plugin's logic against the runtime's documented behaviour, not the
hardware. One module per job: calls, faults, completion and streams, graphs, host_memory and memory, patching,
device_module, runtime and accelerator, extension (vendor extensions installing ``torch.<device>``), catalog
(:func:`emulate`, :func:`emulated_runtimes`). Writing one: docs/plugin-authoring.md, "Shipping an emulated
runtime".
"""

from .accelerator import emulate_accelerator
from .calls import CallLog, CallRecord
from .catalog import EmulationCatalog, EmulationError, Offer, emulate, emulated_runtimes
from .completion import AsyncQueue, Completion
from .device_module import DeviceModuleFunctions, device_index
from .extension import ExtensionRuntime, RuntimeBinding
from .faults import Faults
from .graphs import EmulatedGraph, GraphCaptureError, GraphRecorder, install_graph_api
from .host_memory import HostMemoryTable, PinnedHost
from .marker import EMULATED, EMULATED_MARKER, is_emulated_module, mark_emulated
from .memory import AllocationTracker, MemoryCounters
from .patching import Patcher
from .runtime import EmulatedRuntime, emulation_fixture, missing_library_error
from .streams import EmulatedEvent, EmulatedStream

__all__ = [
    "EMULATED", "EMULATED_MARKER", "AllocationTracker", "AsyncQueue", "CallLog", "CallRecord", "Completion",
    "DeviceModuleFunctions", "EmulatedEvent", "EmulatedGraph", "EmulatedRuntime", "EmulatedStream", "EmulationCatalog",
    "EmulationError", "ExtensionRuntime", "Faults", "GraphCaptureError", "GraphRecorder", "HostMemoryTable",
    "MemoryCounters", "Offer", "Patcher", "PinnedHost", "RuntimeBinding", "device_index", "emulate",
    "emulate_accelerator", "emulated_runtimes", "emulation_fixture", "install_graph_api", "is_emulated_module",
    "mark_emulated", "missing_library_error",
]
