"""CPU-backed stand-ins for vendor runtimes, so CI exercises every plugin code path.

Each emulated runtime lives in ``polyaccel.testing.emulation.<plugin name>`` and exposes
``emulate(**faults)``: a context manager that installs the stand-in (fake modules in
``sys.modules``, attributes on ``torch``), resets polyaccel's selection so the plugin's
``probe()`` sees it, and yields the runtime object. The runtime records every call in
``runtime.calls`` and takes fault switches (registration refused, unregister failing,
library missing, ...) as keyword arguments. Tensors stay on the CPU; results produced
under emulation are labelled :data:`EMULATED` ("emulated").

Emulation proves a plugin's logic against the runtime's documented behaviour, not the
hardware.
"""

from .base import (
    EMULATED,
    EMULATED_MARKER,
    AsyncQueue,
    CallLog,
    CallRecord,
    Completion,
    EmulatedRuntime,
    Faults,
    Patcher,
    emulation_fixture,
    is_emulated_module,
    missing_library_error,
)

__all__ = [
    "EMULATED", "EMULATED_MARKER", "AsyncQueue", "CallLog", "CallRecord", "Completion", "EmulatedRuntime",
    "Faults", "Patcher", "emulation_fixture", "is_emulated_module", "missing_library_error",
]
