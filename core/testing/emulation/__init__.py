"""A kit for CPU-backed stand-ins of vendor runtimes, so CI exercises every plugin code path.

The kit is generic; each plugin ships its own emulated runtime (an :class:`EmulatedRuntime`
subclass, usually in ``<plugin>/emulation.py``) and offers it through the
``polyaccel_emulated_runtimes`` hook. :func:`emulate` finds one through that hook::

    with emulate("example", device_count=2) as runtime:
        ...  # the plugin's probe, selection and calls now meet the stand-in
        runtime.calls.names()

An active runtime installs its stand-in (fake modules in ``sys.modules``, attributes on
``torch``), resets polyaccel's selection so the plugin's ``probe()`` sees it, and makes the
accelerator it stands in for keep its tensors on the host. It records every call in
``runtime.calls`` and takes fault switches (registration refused, library missing, ...) as
keyword arguments. Results produced under emulation are labelled :data:`EMULATED`.

By job:

- :mod:`.calls` (:class:`CallLog`), :mod:`.faults` (:class:`Faults`): what was asked, what fails.
- :mod:`.completion` (:class:`AsyncQueue`), :mod:`.streams`: work that completes later, in order.
- :mod:`.graphs` (:class:`GraphRecorder`): capture records aten ops, replay recomputes.
- :mod:`.host_memory` (:class:`HostMemoryTable`, :class:`PinnedHost`), :mod:`.memory`
  (:class:`MemoryCounters`): registered host ranges, pinning, device memory statistics.
- :mod:`.patching` (:class:`Patcher`): fake modules, imports that fail or run lazily, all undone.
- :mod:`.device_module`: the ``torch.<device>`` functions every runtime shares.
- :mod:`.runtime` (:class:`EmulatedRuntime`), :mod:`.accelerator`: the runtime base and what
  it changes on the accelerator while active; :mod:`.extension` (:class:`ExtensionRuntime`, :class:`RuntimeBinding`):
  the base of a vendor extension (``torch_npu``, ``torch_supa``) that installs ``torch.<device>``.
- :mod:`.catalog` (:func:`emulate`, :func:`emulated_runtimes`): finding runtimes through the hook.

Emulation proves a plugin's logic against the runtime's documented behaviour, not the hardware.
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
