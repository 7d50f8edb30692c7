"""Choose the one accelerator of this process, lazily and once.

Order: ``set_accelerator()`` > ``POLYACCEL_ACCELERATOR`` > highest-priority available
plugin (a tie between two available plugins is an error that says how to choose). The
rules are in :mod:`polyaccel.selection_rules`; the state (plugins found, the choice) is the
process's :class:`polyaccel.runtime.Runtime`. These functions are the public entry points.
"""

from __future__ import annotations

from typing import Any

from .accelerator import Accelerator
from .discovery import PluginSet
from .runtime import current


def register_plugin(name: str, plugin: Any) -> None:
    """Register a plugin object without an entry point (tests, notebooks, embedding apps).

    Takes effect on the next discovery; call :func:`reset` if discovery already ran.
    """
    current().register_plugin(name, plugin)


def reset() -> None:
    """Forget discovery and selection (for tests and for re-reading the env switches)."""
    current().reset()


def plugins() -> PluginSet:
    """Discover, probe and register the op builders of all plugins once; later calls return the same set.

    Op registration is part of discovery, before any selection: a plugin whose op hook
    raises is isolated like one whose other hooks raise, so it is never selected and
    ``polyaccel report`` shows why.
    """
    return current().plugins()


def set_accelerator(accelerator: str | Accelerator) -> Accelerator:
    """Pin this process's accelerator by plugin name or instance; overrides everything else."""
    return current().set_accelerator(accelerator)


def get_accelerator() -> Accelerator:
    """The accelerator of this process, selected on first call."""
    return current().accelerator()


def selected_or_none() -> Accelerator | None:
    return current().selected


def accelerator_for_device_type(device_type: str) -> Accelerator | None:
    """The usable accelerator serving ``device_type``: the selected one first, else any available."""
    return current().accelerator_for(device_type)
