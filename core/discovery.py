"""Find plugins through entry points, isolate broken ones, and remember why.

Core holds no list of backend names: the in-tree plugins are found exactly like a
third party's, through the ``polyaccel.plugins`` entry-point group.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import traceback
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .accelerator import Accelerator, ProbeResult
from .host_accelerator import with_host_defaults
from .version import API_VERSION, api_major

ENTRY_POINT_GROUP = "polyaccel.plugins"

# Plugin statuses, as shown by `polyaccel report`.
SELECTED = "selected"
AVAILABLE = "available"
UNAVAILABLE = "unavailable"
FAILED = "failed"
BLOCKED = "blocked"
INCOMPATIBLE = "incompatible"
DUPLICATE = "duplicate"
#: a plugin without an accelerator (op builders, comm or report hooks only): loaded, nothing to select
LOADED = "loaded"

#: statuses of plugins whose hooks are registered and whose op builders are used
LOADED_STATUSES = (SELECTED, AVAILABLE, UNAVAILABLE, LOADED)

#: how a name claimed by several plugins is settled, in the words every loser's reason uses
NAME_PRECEDENCE = (
    "polyaccel's own plugins first, then other distributions in alphabetical order of their "
    "distribution names, then plugins passed to polyaccel.register_plugin()"
)


@dataclass
class PluginRecord:
    """One plugin (entry point) and, when it provides one, its accelerator."""

    name: str
    source: str  # "entry point pkg.mod:obj (dist 1.0)" or "registered"
    status: str = AVAILABLE
    reason: str = ""
    api_version: str | None = None
    accelerator_cls: type[Accelerator] | None = None
    accelerator: Accelerator | None = None
    probe: ProbeResult | None = None
    plugin: Any = None
    emulated: bool = False
    #: the distribution the entry point comes from (None: registered, or unknown)
    dist_name: str | None = None

    @property
    def priority(self) -> int:
        return self.accelerator_cls.priority if self.accelerator_cls else 0

    @property
    def by_name_only(self) -> bool:
        """An available accelerator with a negative priority: never auto-selected, only by name."""
        return self.accelerator_cls is not None and self.status == AVAILABLE and self.priority < 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "reason": self.reason,
            "source": self.source,
            "api_version": self.api_version,
            "priority": self.priority if self.accelerator_cls else None,
            "device_type": self.accelerator_cls.device_type if self.accelerator_cls else None,
            "device_count": self.probe.device_count if self.probe else None,
            "emulated": self.emulated,
        }


def _env_list(var: str) -> list[str] | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    return [x.strip() for x in raw.split(",") if x.strip()]


def _short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class PluginSet:
    """The outcome of discovery: a pluggy manager with the good plugins, and a record of all."""

    pm: pluggy.PluginManager
    records: dict[str, PluginRecord] = field(default_factory=dict)

    def accelerators(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if r.accelerator_cls is not None]

    def usable(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if r.status in (AVAILABLE, SELECTED)]

    def summary(self) -> str:
        if not self.records:
            return "  (no plugins found in entry-point group 'polyaccel.plugins')"
        lines = []
        for r in self.records.values():
            extra = f": {r.reason}" if r.reason else ""
            emu = " [emulated]" if r.emulated else ""
            if r.by_name_only:
                extra += (f" (priority {r.priority}: selectable by name only, "
                          f"POLYACCEL_ACCELERATOR={r.accelerator_cls.name})")
            lines.append(f"  - {r.name}: {r.status}{emu}{extra}")
        return "\n".join(lines)

    def find(self, name: str) -> PluginRecord | None:
        """The record providing the accelerator called ``name`` (plugin or accelerator name), else the plugin's."""
        for rec in self.records.values():
            if rec.accelerator_cls is not None and name in (rec.name, rec.accelerator_cls.name):
                return rec
        return self.records.get(name)

    def mark_selected(self, accelerator: Accelerator) -> None:
        """Show ``accelerator``'s record as selected (and a previous choice as available again)."""
        for rec in self.records.values():
            if rec.status == SELECTED:
                rec.status = AVAILABLE
            if rec.accelerator is accelerator:
                rec.status = SELECTED


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def plugin_hook(pm: pluggy.PluginManager, hook_name: str, plugin: Any):
    """``pm.hook.<hook_name>`` restricted to ``plugin``'s implementation: what it raises is that plugin's alone.

    Calling it returns pluggy's list of results (empty when the plugin does not implement the hook).
    """
    others = [p for p in pm.get_plugins() if p is not plugin]
    return pm.subset_hook_caller(hook_name, remove_plugins=others)


def _check_api_version(plugin: Any, rec: PluginRecord) -> bool:
    version = getattr(plugin, "POLYACCEL_API_VERSION", None)
    if version is None:
        rec.status = INCOMPATIBLE
        rec.reason = (
            "plugin does not declare POLYACCEL_API_VERSION; set it to the contract version "
            f"it was written for (this polyaccel: {API_VERSION})"
        )
        return False
    rec.api_version = str(version)
    try:
        major = api_major(version)
    except ValueError:
        rec.status = INCOMPATIBLE
        rec.reason = f"POLYACCEL_API_VERSION {version!r} is not 'MAJOR.MINOR'"
        return False
    if major != api_major(API_VERSION):
        rec.status = INCOMPATIBLE
        rec.reason = f"written for contract {version}, this polyaccel provides {API_VERSION}"
        return False
    return True


def _accelerator_classes(pm: pluggy.PluginManager, plugin: Any) -> list[type[Accelerator]]:
    classes: list = []
    for answer in plugin_hook(pm, "polyaccel_accelerators", plugin)():
        if answer is None:
            continue
        classes += [answer] if isinstance(answer, type) else list(answer)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, Accelerator)):
            raise TypeError(f"polyaccel_accelerators returned {cls!r}, not an Accelerator subclass")
        if not cls.name:
            raise TypeError(f"{cls.__name__} has no 'name'")
    return [with_host_defaults(cls) for cls in classes]


def _normalize(dist_name: str) -> str:
    return re.sub(r"[-_.]+", "-", dist_name).lower()


def _entry_point_candidates(group: str = ENTRY_POINT_GROUP) -> list[tuple[str, str, Any, str | None]]:
    """Every entry point of ``group`` as (name, source, loader, distribution name), in precedence order.

    The order is fixed by :data:`NAME_PRECEDENCE`, never by install or metadata order: the
    ``polyaccel`` distribution first, then the others sorted by normalized distribution name;
    entry points of one distribution keep the order of its metadata.
    """
    found = []
    seen_eps: set[tuple[str, str]] = set()
    for index, ep in enumerate(md.entry_points(group=group)):
        if (ep.name, ep.value) in seen_eps:
            continue  # the same distribution visible twice on sys.path
        seen_eps.add((ep.name, ep.value))
        dist = getattr(ep, "dist", None)
        dist_name = None
        where = ""
        if dist is not None:
            dist_name = dist.name
            where = f" ({dist.name} {dist.version})"
        norm = _normalize(dist_name) if dist_name else "\uffff"  # unknown distribution: last
        key = (0 if norm == "polyaccel" else 1, norm, index)
        found.append((key, ep.name, f"entry point {ep.value}{where}", ep.load, dist_name))
    found.sort(key=lambda item: item[0])
    return [item[1:] for item in found]


def _blocked_reason(name: str, source: str, allow: list[str] | None, block: set[str]) -> str | None:
    if name in block:
        return "listed in POLYACCEL_DISABLE_PLUGINS"
    if allow is not None and name not in allow and source != "registered":
        return f"not in POLYACCEL_PLUGINS={','.join(allow)}"
    return None


def _record_key(result: PluginSet, name: str) -> str:
    """``name``, or ``name#N`` (unused) when a record already holds ``name``."""
    if name not in result.records:
        return name
    n = len(result.records)
    while f"{name}#{n}" in result.records:
        n += 1
    return f"{name}#{n}"


def _candidates(extra_plugins: list[tuple[str, Any]] | None) -> list[tuple[str, str, Any, str | None]]:
    """Entry points (unless autoload is disabled), then the registered plugins: (name, source, loader, dist)."""
    found = []
    if os.environ.get("POLYACCEL_DISABLE_PLUGIN_AUTOLOAD", "").strip() not in ("1", "true", "yes"):
        found += _entry_point_candidates()
    for name, obj in extra_plugins or []:
        found.append((name, "registered", lambda obj=obj: obj, None))
    return found


def discover(extra_plugins: list[tuple[str, Any]] | None = None) -> PluginSet:
    """Load entry-point plugins (subject to the env switches) plus explicitly registered ones.

    Never raises because of a plugin: every failure is recorded on its record. Blocked
    plugins are recorded as blocked before any name clash is considered; among the rest,
    a plugin name claimed twice goes to the first in :data:`NAME_PRECEDENCE` order, and
    the other is recorded as a duplicate whose reason names the winner.
    """
    result = PluginSet(new_plugin_manager())
    allow = _env_list("POLYACCEL_PLUGINS")
    block = set(_env_list("POLYACCEL_DISABLE_PLUGINS") or [])
    winners: dict[str, PluginRecord] = {}  # plugin name -> the record that holds it
    blocked_names: set[str] = set()
    for name, source, loader, dist_name in _candidates(extra_plugins):
        blocked = _blocked_reason(name, source, allow, block)
        if blocked is not None:
            _add_record(result, name, source, dist_name, BLOCKED, blocked)
            blocked_names.add(name)
        elif name in winners:
            _add_record(result, name, source, dist_name, DUPLICATE, (
                f"plugin name {name!r} is also provided by {winners[name].source}, which wins "
                f"({NAME_PRECEDENCE}); this one is ignored"))
        else:
            winners[name] = _claim_name(result, name, source, dist_name)
            _load(result, winners[name], loader)
    for name in blocked_names - set(winners):
        result.pm.set_blocked(name)
    return result


def _add_record(result: PluginSet, name: str, source: str, dist_name: str | None, status: str,
                reason: str) -> PluginRecord:
    """A record for a plugin that is not loaded; under ``name#N`` when ``name`` is taken."""
    rec = PluginRecord(name=_record_key(result, name), source=source, dist_name=dist_name, status=status,
                       reason=reason)
    result.records[rec.name] = rec
    return rec


def _claim_name(result: PluginSet, name: str, source: str, dist_name: str | None) -> PluginRecord:
    """The record of the plugin that loads under ``name``; a blocked record holding the name moves aside."""
    if name in result.records:
        key = _record_key(result, name)
        held = result.records.pop(name)
        held.name = key
        result.records[key] = held
    rec = PluginRecord(name=name, source=source, dist_name=dist_name)
    result.records[name] = rec
    return rec


def _load(result: PluginSet, rec: PluginRecord, loader) -> None:
    """Import the plugin, check its contract version, register its hooks and attach its accelerators."""
    try:
        plugin = loader()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a plugin must never break discovery
        rec.status = FAILED
        rec.reason = f"import failed: {_short_error(exc)}"
        rec.plugin = traceback.format_exc()
        return
    rec.plugin = plugin
    if not _check_api_version(plugin, rec):
        return
    try:
        result.pm.register(plugin, name=rec.name)
    except Exception as exc:  # noqa: BLE001
        rec.status = FAILED
        rec.reason = f"could not register hooks: {_short_error(exc)}"
        return
    try:
        classes = _accelerator_classes(result.pm, plugin)
    except Exception as exc:  # noqa: BLE001
        result.pm.unregister(plugin)
        rec.status = FAILED
        rec.reason = f"polyaccel_accelerators raised {_short_error(exc)}"
        return
    _attach_accelerators(result, rec, classes)


def _attach_accelerators(result: PluginSet, rec: PluginRecord, classes: list[type[Accelerator]]):
    """The plugin's first accelerator lives on its record; further ones get records of their own."""
    taken = {r.accelerator_cls.name: r for r in result.records.values() if r.accelerator_cls}
    if not classes:
        rec.status = LOADED
        rec.reason = "provides no accelerator (nothing to select); its hooks are in use"
    for i, cls in enumerate(classes):
        target = rec
        if i > 0:
            target = PluginRecord(name=cls.name, source=rec.source, plugin=rec.plugin, dist_name=rec.dist_name)
            target.api_version = rec.api_version
            if cls.name in result.records:
                target.name = f"{cls.name}#{len(result.records)}"
            result.records[target.name] = target
        if cls.name in taken:
            target.status = DUPLICATE
            target.reason = (f"accelerator name {cls.name!r} is also provided by {taken[cls.name].source}, "
                             f"which wins ({NAME_PRECEDENCE}); this one is ignored")
            continue
        if api_major(cls.api_version) != api_major(API_VERSION):
            target.status = INCOMPATIBLE
            target.api_version = cls.api_version
            target.reason = (
                f"accelerator written for contract {cls.api_version}, this polyaccel provides {API_VERSION}"
            )
            continue
        target.accelerator_cls = cls
        taken[cls.name] = target


def probe_all(result: PluginSet) -> None:
    """Instantiate and probe every accelerator that is still in the running."""
    for rec in result.accelerators():
        if rec.status not in (AVAILABLE,):
            continue
        try:
            acc = rec.accelerator_cls()
            probe = acc.probe()
            if not isinstance(probe, ProbeResult):
                raise TypeError(f"probe() returned {type(probe).__name__}, expected ProbeResult")
        except Exception as exc:  # noqa: BLE001
            rec.status = FAILED
            rec.reason = f"probe raised {_short_error(exc)}"
            continue
        rec.accelerator = acc
        rec.probe = probe
        rec.emulated = bool(probe.emulated)
        rec.reason = probe.reason or ""
        if not probe.available:
            rec.status = UNAVAILABLE
            rec.reason = probe.reason or "probe() reported unavailable"


def isolate(result: PluginSet, rec: PluginRecord, reason: str) -> None:
    """Take a loaded plugin out of use after one of its set-up hooks raised.

    Every record of the plugin (one per accelerator it provides) becomes ``failed`` with
    ``reason``, and its hooks are unregistered, so neither its accelerator nor its comm or
    report hooks are used. A plugin whose accelerator is already selected cannot be taken
    back: it keeps that status and the reason says what is missing.
    """
    same = [r for r in result.records.values()
            if r is rec or (rec.plugin is not None and r.plugin is rec.plugin and r.status in LOADED_STATUSES)]
    if any(r.status == SELECTED for r in same):
        for r in same:
            r.reason = f"{reason}; its accelerator was already selected, so it stays in use without its op builders"
        return
    for r in same:
        what = "its accelerator is not used and " if r.accelerator_cls is not None else ""
        before = f" (before that it was {r.status}: {r.reason})" if r.status == UNAVAILABLE and r.reason else ""
        r.status = FAILED
        r.reason = f"{reason}; the plugin is isolated: {what}its op builders are dropped{before}"
    try:
        if result.pm.get_plugin(rec.name) is not None:
            result.pm.unregister(name=rec.name)
    except Exception:  # noqa: BLE001 - isolation must not fail on pluggy's bookkeeping
        pass
