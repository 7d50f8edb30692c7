"""Find emulated runtimes through the ``polyaccel_emulated_runtimes`` hook, and only there.

Each loaded plugin's implementation is called on its own (pluggy's normal call, on a hook
caller holding that plugin alone), so a plugin whose hook raises or answers with something
that is not an :class:`~.runtime.EmulatedRuntime` loses only its own offers: the others stay
usable and the reason is kept for whoever asks for the broken one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from ...errors import PolyaccelError
from .runtime import EmulatedRuntime

HOOK = "polyaccel_emulated_runtimes"


class EmulationError(PolyaccelError):
    """No usable emulated runtime for the accelerator asked for; the message lists what there is."""


@dataclass(frozen=True)
class Offer:
    """One emulated runtime a plugin offers."""

    name: str
    runtime: type[EmulatedRuntime]
    plugin: str


@dataclass
class EmulationCatalog:
    """Every emulated runtime the installed plugins offer, and the plugins whose offer is broken."""

    offers: dict[str, Offer] = field(default_factory=dict)
    #: plugin name -> why its hook gave nothing usable
    broken: dict[str, str] = field(default_factory=dict)
    #: offers that lost to an earlier plugin's offer of the same name
    shadowed: list[Offer] = field(default_factory=list)
    #: plugin name -> why discovery could not load it (its offer, if any, is unknown)
    unloaded: dict[str, str] = field(default_factory=dict)

    def names(self) -> list[str]:
        return sorted(self.offers)

    def runtime(self, name: str) -> type[EmulatedRuntime]:
        offer = self.offers.get(name)
        if offer is None:
            raise EmulationError(f"no emulated runtime for plugin {name!r}: no installed plugin offers one "
                                 f"through the {HOOK} hook ({self.describe()})")
        return offer.runtime

    def describe(self) -> str:
        have = ", ".join(f"{o.name} (plugin {o.plugin})" for o in sorted(self.offers.values(), key=lambda o: o.name))
        text = f"emulated runtimes available: {have or 'none'}"
        if self.broken:
            text += "; plugins whose emulated runtimes are unusable: " + "; ".join(
                f"{plugin}: {reason}" for plugin, reason in self.broken.items())
        if self.unloaded:
            text += "; plugins that could not be loaded: " + "; ".join(
                f"{plugin} ({reason})" for plugin, reason in self.unloaded.items())
        return text


def _runtime_classes(answer: Any) -> list[type[EmulatedRuntime]]:
    if isinstance(answer, type):
        classes = [answer]
    elif isinstance(answer, (list, tuple)):
        classes = list(answer)
    else:
        raise TypeError(f"{HOOK} returned {answer!r}; return a list of EmulatedRuntime subclasses")
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, EmulatedRuntime)):
            raise TypeError(f"{HOOK} returned {cls!r}, not a polyaccel.testing.emulation.EmulatedRuntime subclass")
        if not cls.name:
            raise TypeError(f"{cls.__name__} has no 'name' (the accelerator it stands in for)")
        acc = cls.accelerator
        if acc is not None and acc.name != cls.name:
            raise TypeError(f"{cls.__name__} is named {cls.name!r} but stands in for accelerator {acc.name!r}")
    return classes


def _collect(catalog: EmulationCatalog, pm) -> None:
    plugins = pm.get_plugins()
    implementers = {impl.plugin_name for impl in getattr(pm.hook, HOOK).get_hookimpls()}
    for plugin_name, plugin in pm.list_name_plugin():  # registration order: discovery's precedence
        if plugin_name not in implementers:
            continue
        only_this = pm.subset_hook_caller(HOOK, remove_plugins=[p for p in plugins if p is not plugin])
        try:
            answers = only_this()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - one plugin's broken emulation is isolated
            catalog.broken[plugin_name] = f"{HOOK} raised {type(exc).__name__}: {exc}"
            continue
        try:
            classes = [cls for answer in answers for cls in _runtime_classes(answer)]
        except TypeError as exc:
            catalog.broken[plugin_name] = str(exc)
            continue
        for cls in classes:
            offer = Offer(cls.name, cls, plugin_name)
            if cls.name in catalog.offers:
                catalog.shadowed.append(offer)
            else:
                catalog.offers[cls.name] = offer


def emulated_runtimes() -> EmulationCatalog:
    """Ask every loaded plugin (entry points, with the ``POLYACCEL_*PLUGINS`` switches) for its emulated runtimes.

    Loads the plugins afresh and probes nothing, so it leaves this process's selection alone.
    """
    from ... import discovery

    catalog = EmulationCatalog()
    found = discovery.discover()
    _collect(catalog, found.pm)
    for name, rec in found.records.items():
        if rec.status in (discovery.FAILED, discovery.INCOMPATIBLE):
            catalog.unloaded[name] = f"{rec.status}: {rec.reason}"
    return catalog


def emulate(name: str, **options: Any) -> contextlib.AbstractContextManager[EmulatedRuntime]:
    """Install the emulated runtime for accelerator ``name`` for a ``with`` block; yields the runtime.

    ``options`` are the runtime's own (``device_count=2``, fault switches such as
    ``library_missing=True``). Raises :class:`EmulationError` when no plugin offers one.
    """
    return emulated_runtimes().runtime(name).emulate(**options)
