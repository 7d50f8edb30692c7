"""The example device's vendor runtime, found the way a real plugin finds its own.

A real device comes with a vendor runtime: a Python extension the plugin imports when it is
probed (never at ``import polyaccel``) and asks whether a device is there. The example device
is the host, so no such extension exists to install: without one the plugin presents the
host CPU. Its emulated runtime (:mod:`.emulation`) stands in for one, so tests on any machine
exercise the path a real runtime takes, including a runtime that sees no device.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

#: the vendor runtime's import name
RUNTIME_MODULE = "example_device_runtime"


def find_runtime() -> ModuleType | None:
    """The vendor runtime module, or None where none is installed."""
    module = sys.modules.get(RUNTIME_MODULE)
    if module is None and importlib.util.find_spec(RUNTIME_MODULE) is not None:
        module = importlib.import_module(RUNTIME_MODULE)
    return module
