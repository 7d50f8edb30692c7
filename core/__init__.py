"""polyaccel: a plugin-based hardware abstraction platform for PyTorch training.

Importing polyaccel is cheap: it loads no plugin, no triton and no vendor runtime.
Plugins are discovered and the accelerator selected on the first
:func:`get_accelerator` call.
"""

from __future__ import annotations

from .errors import ConfigError, InvalidArgument, OpArgumentError, OpError, PolyaccelError, SelectionError, Unsupported
from .version import API_VERSION

__version__ = "0.1.0"

_LAZY = {
    # name: (module, attribute or None for the module itself)
    "get_accelerator": ("selection", "get_accelerator"),
    "set_accelerator": ("selection", "set_accelerator"),
    "register_plugin": ("selection", "register_plugin"),
    "Accelerator": ("accelerator", "Accelerator"),
    "HostAccelerator": ("host_accelerator", "HostAccelerator"),
    "ProbeResult": ("accelerator", "ProbeResult"),
    "hookimpl": ("hookspecs", "hookimpl"),
    "ops": ("ops", None),
    "optim": ("optim", None),
    "comm": ("comm", None),
    "testing": ("testing", None),
    "sequence": ("sequence", None),
}


def __getattr__(name: str):
    if name == "initialize":
        from .engine_entry import initialize

        return initialize
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'polyaccel' has no attribute {name!r}") from None
    import importlib

    mod = importlib.import_module(f"{__name__}.{module}")
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


__all__ = [
    "API_VERSION", "Accelerator", "ConfigError", "HostAccelerator", "InvalidArgument", "OpArgumentError", "OpError",
    "PolyaccelError", "ProbeResult", "SelectionError", "Unsupported", "get_accelerator", "hookimpl", "initialize",
    "ops", "optim", "register_plugin", "set_accelerator",
]
