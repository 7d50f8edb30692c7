"""How the accelerator is chosen from the plugins found: by name, or the highest priority available.

Pure functions of a :class:`~polyaccel.discovery.PluginSet`; the runtime applies them
(``polyaccel.set_accelerator`` > ``POLYACCEL_ACCELERATOR`` > priority), once per process.
"""

from __future__ import annotations

from .accelerator import Accelerator
from .discovery import AVAILABLE, SELECTED, PluginSet
from .errors import SelectionError


def _plugins_found(found: PluginSet) -> str:
    return "Plugins found:\n" + found.summary()


def by_name(found: PluginSet, name: str, origin: str) -> Accelerator:
    """The accelerator of the plugin (or accelerator) called ``name``; ``origin`` says who asked, for errors."""
    rec = found.find(name)
    if rec is None:
        raise SelectionError(f"{origin}: no accelerator plugin named {name!r} is installed.\n{_plugins_found(found)}")
    if rec.accelerator_cls is None:
        raise SelectionError(
            f"{origin}: plugin {name!r} provides no accelerator ({rec.status}: {rec.reason}).\n{_plugins_found(found)}"
        )
    if rec.status not in (AVAILABLE, SELECTED):
        raise SelectionError(
            f"{origin}: accelerator {name!r} is {rec.status}: {rec.reason}.\n{_plugins_found(found)}"
        )
    return rec.accelerator


def by_priority(found: PluginSet) -> Accelerator:
    """The available accelerator with the highest priority; a tie at the top is an error that says how to choose."""
    usable = [r for r in found.accelerators() if r.status == AVAILABLE and r.priority >= 0]
    if not usable:
        raise SelectionError(_nothing_to_select(found))
    usable.sort(key=lambda r: r.priority, reverse=True)
    best = usable[0]
    ties = [r for r in usable if r.priority == best.priority]
    if len(ties) > 1:
        names = ", ".join(sorted(r.name for r in ties))
        raise SelectionError(
            f"several available accelerators share the top priority {best.priority}: {names}. "
            f"Choose one with POLYACCEL_ACCELERATOR=<name> or polyaccel.set_accelerator(name), "
            f"or disable the others with POLYACCEL_DISABLE_PLUGINS.\n{_plugins_found(found)}"
        )
    return best.accelerator


def _nothing_to_select(found: PluginSet) -> str:
    by_name_only = [r for r in found.accelerators() if r.by_name_only]
    if not by_name_only:
        return ("no accelerator is available. Install a backend plugin (for example "
                "`pip install polyaccel[<backend>]`) or check the reasons below.\n" + _plugins_found(found))
    names = [r.accelerator_cls.name for r in by_name_only]
    one = len(names) == 1
    listed = ", ".join(f"{r.accelerator_cls.name!r} (priority {r.priority})" for r in by_name_only)
    example = names[0] if one else "<name>"
    return (
        f"no accelerator can be selected automatically: the available "
        f"{'accelerator' if one else 'accelerators'} {listed} "
        f"{'is' if one else 'are'} selectable by name only (a negative priority "
        f"means never auto-selected). Select {'it' if one else 'one'} with "
        f"POLYACCEL_ACCELERATOR={example} or polyaccel.set_accelerator({example!r})"
        + ("" if one else f" ({', '.join(names)})")
        + ", or install a backend plugin that is selected automatically "
        "(for example `pip install polyaccel[<backend>]`).\n" + _plugins_found(found)
    )
