"""The process's polyaccel state, in one object.

A :class:`Runtime` holds the plugins found by discovery, the selected accelerator, the op
registry and the comm session. ``selection``, ``ops``, ``comm`` and ``report`` reach that
state through :func:`current`; none of them imports another for it. This module imports
only the layers below it (discovery, the selection rules, the accelerator contract), and
the op registry's modules inside the methods that need them: the op entry points of
``polyaccel.ops`` import this module.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import discovery, selection_rules
from .accelerator import Accelerator
from .discovery import AVAILABLE, SELECTED, PluginSet
from .errors import SelectionError

if TYPE_CHECKING:
    from .ops.registry import OpRegistry

_log = logging.getLogger("polyaccel")


@dataclass
class CommSession:
    """What ``polyaccel.comm`` set up in this process; all unset before ``init_distributed``."""

    accelerator: Accelerator | None = None
    #: the ``polyaccel.comm.CommHooks`` in force (``comm.set_hooks`` may change them); None: plain calls
    hooks: Any = None
    #: the world group's collective timeout
    timeout: datetime.timedelta | None = None
    #: False when the process group was created outside polyaccel
    owned: bool = False
    #: host buffers for staged collectives (``polyaccel.comm.staging.StagingPool``), made on first use
    staging_pool: Any = None

    @property
    def active(self) -> bool:
        return self.accelerator is not None

    def end(self) -> None:
        self.accelerator = None
        self.timeout = None
        self.owned = False
        self.staging_pool = None


class _MadeOnFirstUse:
    """An attribute made by ``make(instance)`` on first read, then stored on the instance.

    A non-data descriptor, so once stored the instance's own attribute answers every read
    without a call: the op registry is read on every op call. ``make`` guards itself (the
    runtime's lock); this class takes no lock of its own, so it cannot order locks against it.
    """

    def __init__(self, make) -> None:
        self._make = make
        self.__doc__ = make.__doc__

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return self._make(instance)


class Runtime:
    """Plugins, the selected accelerator, the op registry and the comm session of one process.

    Discovery runs once, on first need; op registration is part of it (a plugin whose op
    hook raises is isolated before anything is selected). Selection runs once, on the first
    :meth:`accelerator` call, unless :meth:`set_accelerator` chose first.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._registered: list[tuple[str, Any]] = []
        self._plugins: PluginSet | None = None
        self._selected: Accelerator | None = None
        self.comm = CommSession()

    # ------------------------------------------------------------------ plugins
    def register_plugin(self, name: str, plugin: Any) -> None:
        """Add a plugin object without an entry point; used by the next discovery (see :meth:`reset`)."""
        with self.lock:
            self._registered.append((name, plugin))

    @property
    def discovered(self) -> bool:
        return self._plugins is not None

    def plugins(self) -> PluginSet:
        """Discover and probe every plugin and register their op builders, once."""
        with self.lock:
            if self._plugins is None:
                found = discovery.discover(list(self._registered))
                discovery.probe_all(found)
                self._plugins = found
                self.ops.ops()  # populates the registry: every plugin's op hook runs now
                for rec in found.records.values():
                    if rec.status == discovery.FAILED:
                        _log.warning("polyaccel: plugin %r (%s) failed: %s", rec.name, rec.source, rec.reason)
            return self._plugins

    # -------------------------------------------------------------------- ops
    def _make_ops(self) -> OpRegistry:
        """The op registry, made on first use and then kept (reset empties it); filled from :meth:`plugins`."""
        with self.lock:
            registry = self.__dict__.get("ops")
            if registry is None:
                from .ops.registry import OpRegistry

                registry = OpRegistry(self.accelerator_for, lock=self.lock)
                registry.set_populator(self._register_ops)
                self.__dict__["ops"] = registry
            return registry

    #: the op registry (:meth:`_make_ops`); every op call reads it, as a plain attribute once made
    ops = _MadeOnFirstUse(_make_ops)

    def _register_ops(self, registry: OpRegistry) -> None:
        from .ops.registration import register_all

        register_all(registry, self.plugins())

    # -------------------------------------------------------------- selection
    @property
    def selected(self) -> Accelerator | None:
        """The selected accelerator, or None while nothing has asked for one."""
        return self._selected

    def accelerator(self) -> Accelerator:
        """This process's accelerator: chosen on first call by the rules of :mod:`polyaccel.selection_rules`."""
        acc = self._selected
        if acc is not None:
            return acc
        with self.lock:
            if self._selected is None:
                found = self.plugins()
                env = os.environ.get("POLYACCEL_ACCELERATOR", "").strip()
                if env:
                    acc = selection_rules.by_name(found, env, f"POLYACCEL_ACCELERATOR={env}")
                else:
                    acc = selection_rules.by_priority(found)
                self._select(found, acc)
            return self._selected

    def set_accelerator(self, accelerator: str | Accelerator) -> Accelerator:
        """Pin this process's accelerator by plugin name or instance; overrides everything else."""
        with self.lock:
            found = self.plugins()
            if isinstance(accelerator, Accelerator):
                acc = accelerator
                probe = acc.probe()
                if not probe.available:
                    raise SelectionError(f"set_accelerator: {acc.name!r} is unavailable: {probe.reason}")
            elif isinstance(accelerator, str):
                acc = selection_rules.by_name(found, accelerator, "set_accelerator")
            else:
                raise TypeError(
                    f"set_accelerator takes a plugin name or an Accelerator, not {type(accelerator).__name__}"
                )
            self._select(found, acc)
            return acc

    def _select(self, found: PluginSet, acc: Accelerator) -> None:
        self._selected = acc
        found.mark_selected(acc)

    def accelerator_for(self, device_type: str | None) -> Accelerator | None:
        """The usable accelerator serving ``device_type``: the selected one first, else the best available.

        ``None`` asks for this process's accelerator (selecting it if nothing has yet).
        """
        if device_type is None:
            return self.accelerator()
        sel = self._selected
        if sel is not None and sel.device_type == device_type:
            return sel
        candidates = [
            r for r in self.plugins().accelerators()
            if r.accelerator is not None and r.status in (AVAILABLE, SELECTED)
            and r.accelerator_cls.device_type == device_type
        ]
        candidates.sort(key=lambda r: r.priority, reverse=True)
        return candidates[0].accelerator if candidates else None

    # ------------------------------------------------------------------ reset
    def reset(self) -> None:
        """Forget discovery, selection, registered plugins and op choices (tests; re-reading the env switches).

        The comm session is left alone: a live process group ends with ``polyaccel.comm.destroy()``.
        """
        with self.lock:
            self._plugins = None
            self._selected = None
            self._registered.clear()
            registry = self.__dict__.get("ops")
            if registry is not None:
                registry.reset()


_RUNTIME = Runtime()


def current() -> Runtime:
    """The runtime of this process."""
    return _RUNTIME


def reset() -> None:
    """Forget discovery, selection, registered plugins and op choices of this process's runtime."""
    _RUNTIME.reset()
