"""Find engines and model layers through entry points, check them against their Protocols, isolate broken ones.

The same rules as plugin discovery (:mod:`polyaccel.discovery`): the entry points of a group are taken in
:data:`~polyaccel.discovery.NAME_PRECEDENCE` order, a name claimed twice goes to the first and the other is
recorded as a duplicate naming the winner, and an entry point that fails to import or does not satisfy its
contract (:mod:`polyaccel.contracts`) is recorded as failed with the reason, never breaking the others.
``polyaccel report`` shows every record; ``polyaccel.initialize`` refuses an isolated one it is asked for,
with that reason.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .contracts import EngineFactory, ModelLayer, TrainingEngine, contract_mismatch
from .discovery import DUPLICATE, FAILED, LOADED, NAME_PRECEDENCE, _entry_point_candidates, _short_error

ENGINE_GROUP = "polyaccel.engines"
LAYER_GROUP = "polyaccel.layers"


@dataclass
class ExtensionRecord:
    """One engine or model-layer entry point and what became of it."""

    name: str
    group: str
    source: str  # "entry point pkg.mod:obj (dist 1.0)"
    status: str = LOADED  # loaded / failed / duplicate
    reason: str = ""
    obj: Any = None  # the loaded engine factory or layer (None unless loaded)
    dist_name: str | None = None
    #: the formatted traceback of a failed import
    traceback: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "group": self.group, "status": self.status, "reason": self.reason,
                "source": self.source}


def _engine_problems(factory: Any) -> list[str]:
    """What keeps ``factory`` from being an :class:`~polyaccel.contracts.EngineFactory`.

    Besides the factory's own shape: ``CONFIG_KEYS`` must be strings, and when the factory's return
    annotation names a class, that class must have the :class:`~polyaccel.contracts.TrainingEngine` methods.
    """
    problems = contract_mismatch(factory, EngineFactory)
    keys = getattr(factory, "CONFIG_KEYS", None)
    if keys is not None and (isinstance(keys, str) or not all(isinstance(k, str) for k in keys)):
        problems.append(f"CONFIG_KEYS must be an iterable of key names, got {keys!r}")
    try:
        returns = inspect.signature(factory, eval_str=True).return_annotation
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: nothing to check it by
        returns = None
    if isinstance(returns, type) and returns is not inspect.Signature.empty:
        problems += [f"its engine class {returns.__name__} {p}"
                     for p in contract_mismatch(returns, TrainingEngine, attributes=False)]
    return problems


def _layer_problems(layer: Any) -> list[str]:
    """What keeps ``layer`` from being a :class:`~polyaccel.contracts.ModelLayer` (``ORDER`` an int,
    ``SIZE_KEYS`` a mapping when present, besides the members)."""
    problems = contract_mismatch(layer, ModelLayer)
    order = getattr(layer, "ORDER", None)
    if order is not None and (isinstance(order, bool) or not isinstance(order, int)):
        problems.append(f"ORDER must be an int, got {order!r}")
    size_keys = getattr(layer, "SIZE_KEYS", None)
    if size_keys is not None and not isinstance(size_keys, Mapping):
        problems.append(f"SIZE_KEYS must map mesh dimensions to config keys, got {size_keys!r}")
    return problems


#: entry-point group -> (what one of it is called, its contract check)
CONTRACTS = {
    ENGINE_GROUP: ("engine", _engine_problems),
    LAYER_GROUP: ("model layer", _layer_problems),
}


def _load(rec: ExtensionRecord, loader) -> None:
    """Import the entry point and check it against its group's contract; a failure is the record's alone."""
    what, problems_of = CONTRACTS[rec.group]
    try:
        obj = loader()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - one extension must never break the others
        rec.status, rec.reason, rec.traceback = FAILED, f"import failed: {_short_error(exc)}", traceback.format_exc()
        return
    try:
        problems = problems_of(obj)
    except Exception as exc:  # noqa: BLE001
        problems = [f"checking it raised {_short_error(exc)}"]
    if problems:
        rec.status = FAILED
        rec.reason = f"does not satisfy the {what} contract (polyaccel.contracts): {'; '.join(problems)}"
        return
    rec.obj = obj


def discover_extensions(group: str, names: set[str] | None = None) -> list[ExtensionRecord]:
    """Every entry point of ``group`` (``names``: only those), loaded and checked, in precedence order."""
    records: list[ExtensionRecord] = []
    winners: dict[str, ExtensionRecord] = {}
    for name, source, loader, dist_name in _entry_point_candidates(group):
        if names is not None and name not in names:
            continue
        rec = ExtensionRecord(name=name, group=group, source=source, dist_name=dist_name)
        records.append(rec)
        if name in winners:
            rec.status = DUPLICATE
            rec.reason = (f"name {name!r} is also provided by {winners[name].source}, which wins "
                          f"({NAME_PRECEDENCE}); this one is ignored")
            continue
        winners[name] = rec
        _load(rec, loader)
    return records


def entry_point_names(group: str) -> list[str]:
    """The names the entry points of ``group`` claim, sorted, none loaded."""
    return sorted({name for name, *_ in _entry_point_candidates(group)})


def by_name(records: list[ExtensionRecord]) -> dict[str, ExtensionRecord]:
    """Name -> the record that holds it (loaded or failed; duplicates left out)."""
    return {rec.name: rec for rec in records if rec.status != DUPLICATE}


__all__ = ["CONTRACTS", "ENGINE_GROUP", "LAYER_GROUP", "ExtensionRecord", "by_name", "discover_extensions",
           "entry_point_names"]
