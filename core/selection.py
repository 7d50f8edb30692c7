"""Choose the one accelerator of this process, lazily and once.

Order: ``set_accelerator()`` > ``POLYACCEL_ACCELERATOR`` > highest-priority available
plugin (a tie between two available plugins is an error that says how to choose).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from . import discovery
from .accelerator import Accelerator
from .discovery import AVAILABLE, SELECTED, PluginRecord, PluginSet
from .errors import SelectionError

_log = logging.getLogger("polyaccel")
_lock = threading.RLock()
_plugins: PluginSet | None = None
_selected: Accelerator | None = None
_requested: str | Accelerator | None = None
_extra_plugins: list[tuple[str, Any]] = []


def register_plugin(name: str, plugin: Any) -> None:
    """Register a plugin object without an entry point (tests, notebooks, embedding apps).

    Takes effect on the next discovery; call :func:`reset` if discovery already ran.
    """
    with _lock:
        _extra_plugins.append((name, plugin))


def reset() -> None:
    """Forget discovery and selection (for tests and for re-reading the env switches)."""
    global _plugins, _selected, _requested
    with _lock:
        _plugins = None
        _selected = None
        _requested = None
        _extra_plugins.clear()
        from . import ops

        ops.registry.reset()


def plugins() -> PluginSet:
    """Discover, probe and register the op builders of all plugins once; later calls return the same set.

    Op registration is part of discovery, before any selection: a plugin whose
    ``polyaccel_register_ops`` raises is isolated like one whose other hooks raise, so it
    is never selected and ``polyaccel report`` shows why.
    """
    global _plugins
    with _lock:
        if _plugins is None:
            ps = discovery.discover(list(_extra_plugins))
            discovery.probe_all(ps)
            _plugins = ps
            from . import ops

            ops.registry.ops()  # populates the registry (calls every polyaccel_register_ops)
            for rec in ps.records.values():
                if rec.status == discovery.FAILED:
                    _log.warning("polyaccel: plugin %r (%s) failed: %s", rec.name, rec.source, rec.reason)
        return _plugins


def _find(ps: PluginSet, name: str) -> PluginRecord | None:
    for rec in ps.records.values():
        if rec.name == name or (rec.accelerator_cls is not None and rec.accelerator_cls.name == name):
            if rec.accelerator_cls is not None:
                return rec
    return ps.records.get(name)


def _explain(ps: PluginSet) -> str:
    return "Plugins found:\n" + ps.summary()


def _select_by_name(ps: PluginSet, name: str, origin: str) -> Accelerator:
    rec = _find(ps, name)
    if rec is None:
        raise SelectionError(f"{origin}: no accelerator plugin named {name!r} is installed.\n{_explain(ps)}")
    if rec.accelerator_cls is None:
        raise SelectionError(
            f"{origin}: plugin {name!r} provides no accelerator ({rec.status}: {rec.reason}).\n{_explain(ps)}"
        )
    if rec.status not in (AVAILABLE, SELECTED):
        raise SelectionError(
            f"{origin}: accelerator {name!r} is {rec.status}: {rec.reason}.\n{_explain(ps)}"
        )
    return rec.accelerator


def _select_by_priority(ps: PluginSet) -> Accelerator:
    usable = [r for r in ps.accelerators() if r.status == AVAILABLE and r.priority >= 0]
    if not usable:
        by_name = [r for r in ps.accelerators() if r.by_name_only]
        if by_name:
            names = [r.accelerator_cls.name for r in by_name]
            listed = ", ".join(f"{r.accelerator_cls.name!r} (priority {r.priority})" for r in by_name)
            one = names[0] if len(names) == 1 else "<name>"
            raise SelectionError(
                f"no accelerator can be selected automatically: the available "
                f"{'accelerator' if len(names) == 1 else 'accelerators'} {listed} "
                f"{'is' if len(names) == 1 else 'are'} selectable by name only (a negative priority "
                f"means never auto-selected). Select {'it' if len(names) == 1 else 'one'} with "
                f"POLYACCEL_ACCELERATOR={one} or polyaccel.set_accelerator({one!r})"
                + (f" ({', '.join(names)})" if len(names) > 1 else "")
                + ", or install a backend plugin that is selected automatically "
                "(for example `pip install polyaccel[cpu]`).\n" + _explain(ps)
            )
        raise SelectionError(
            "no accelerator is available. Install a backend plugin (for example "
            "`pip install polyaccel[cpu]`) or check the reasons below.\n" + _explain(ps)
        )
    usable.sort(key=lambda r: r.priority, reverse=True)
    best = usable[0]
    ties = [r for r in usable if r.priority == best.priority]
    if len(ties) > 1:
        names = ", ".join(sorted(r.name for r in ties))
        raise SelectionError(
            f"several available accelerators share the top priority {best.priority}: {names}. "
            f"Choose one with POLYACCEL_ACCELERATOR=<name> or polyaccel.set_accelerator(name), "
            f"or disable the others with POLYACCEL_DISABLE_PLUGINS.\n{_explain(ps)}"
        )
    return best.accelerator


def _mark_selected(ps: PluginSet, acc: Accelerator) -> None:
    for rec in ps.records.values():
        if rec.status == SELECTED:
            rec.status = AVAILABLE
        if rec.accelerator is acc:
            rec.status = SELECTED


def set_accelerator(accelerator: str | Accelerator) -> Accelerator:
    """Pin this process's accelerator by plugin name or instance; overrides everything else."""
    global _selected, _requested
    with _lock:
        ps = plugins()
        if isinstance(accelerator, Accelerator):
            acc = accelerator
            probe = acc.probe()
            if not probe.available:
                raise SelectionError(f"set_accelerator: {acc.name!r} is unavailable: {probe.reason}")
        elif isinstance(accelerator, str):
            acc = _select_by_name(ps, accelerator, "set_accelerator")
        else:
            raise TypeError(
                f"set_accelerator takes a plugin name or an Accelerator, not {type(accelerator).__name__}"
            )
        _requested = accelerator
        _selected = acc
        _mark_selected(ps, acc)
        return acc


def get_accelerator() -> Accelerator:
    """The accelerator of this process, selected on first call."""
    global _selected
    acc = _selected
    if acc is not None:
        return acc
    with _lock:
        if _selected is not None:
            return _selected
        ps = plugins()
        env = os.environ.get("POLYACCEL_ACCELERATOR", "").strip()
        if env:
            acc = _select_by_name(ps, env, f"POLYACCEL_ACCELERATOR={env}")
        else:
            acc = _select_by_priority(ps)
        _selected = acc
        _mark_selected(ps, acc)
        return acc


def selected_or_none() -> Accelerator | None:
    return _selected


def accelerator_for_device_type(device_type: str) -> Accelerator | None:
    """The usable accelerator serving ``device_type``: the selected one first, else any available."""
    sel = _selected
    if sel is not None and sel.device_type == device_type:
        return sel
    candidates = [
        r for r in plugins().accelerators()
        if r.accelerator is not None and r.status in (AVAILABLE, SELECTED)
        and r.accelerator_cls.device_type == device_type
    ]
    candidates.sort(key=lambda r: r.priority, reverse=True)
    return candidates[0].accelerator if candidates else None
