"""What `polyaccel report` knows: versions, every plugin with its status, capabilities, op choices."""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys
from typing import Any

from .accelerator import Accelerator
from .discovery import LOADED_STATUSES, SELECTED, PluginSet, plugin_hook
from .extensions import ENGINE_GROUP, LAYER_GROUP, discover_extensions
from .ops.registry import OpRegistry
from .runtime import current


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _error(exc: BaseException) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}"}


def build_report() -> dict[str, Any]:
    """A JSON-ready description of this installation (schema documented in docs/report.md)."""
    import torch

    runtime = current()
    found = runtime.plugins()
    selected = None
    selection_error = None
    try:
        selected = runtime.accelerator()
    except Exception as exc:  # noqa: BLE001 - the report must describe a broken setup too
        selection_error = str(exc)
    return {
        "schema": 1,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "polyaccel": _version("polyaccel"),
            "pluggy": _version("pluggy"),
            "triton": _version("triton"),
        },
        "platform": {"system": platform.system(), "machine": platform.machine(),
                     "executable": sys.executable},
        "plugins": [r.as_dict() for r in found.records.values()],
        "selected": None if selected is None else _selected(selected, found),
        "selection_error": selection_error,
        "ops": {} if selected is None else _op_choices(runtime.ops, selected.device_type),
        # plugins whose op hooks failed: isolated, with their dropped builders
        "op_registration_errors": runtime.ops.plugin_failures(),
        "extra": _extra_facts(found, selected),
        # engines and model layers: loaded, or isolated with the reason (polyaccel.extensions)
        "engines": [r.as_dict() for r in discover_extensions(ENGINE_GROUP)],
        "layers": [r.as_dict() for r in discover_extensions(LAYER_GROUP)],
    }


def _selected(acc: Accelerator, found: PluginSet) -> dict[str, Any]:
    from .comm import resolve_hooks

    out: dict[str, Any] = {
        "name": acc.name,
        "device_type": acc.device_type,
        "capabilities": sorted(acc.capabilities()),
        "emulated": acc.is_emulated(),
        "communication_backend": acc.communication_backend,
    }
    try:
        out["comm"] = resolve_hooks(acc, found).as_dict()
    except Exception as exc:  # noqa: BLE001
        out["comm"] = {"error": str(exc)}
    owner = next((r for r in found.records.values() if r.status == SELECTED), None)
    if owner is not None:
        out["plugin_source"] = owner.source
    return out


def _op_choices(registry: OpRegistry, device_type: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op in registry.ops():
        try:
            out[op] = {"device_type": device_type,
                       "candidates": [c.as_dict() for c in registry.candidates(op, device_type)]}
        except Exception as exc:  # noqa: BLE001
            out[op] = {"device_type": device_type, "error": str(exc)}
    return out


def _extra_facts(found: PluginSet, selected: Accelerator | None) -> dict[str, Any]:
    """Plugin name -> what its accelerator says of itself, then what its ``polyaccel_report`` hook adds."""
    extra: dict[str, Any] = {}
    for rec in found.records.values():
        if rec.accelerator is None or rec.status not in LOADED_STATUSES:
            continue
        try:
            facts = rec.accelerator.report_facts()
        except Exception as exc:  # noqa: BLE001 - a report never fails on one plugin
            facts = _error(exc)
        if facts:
            extra[rec.name] = dict(facts)
    for impl in found.pm.hook.polyaccel_report.get_hookimpls():
        try:
            answers = plugin_hook(found.pm, "polyaccel_report", impl.plugin)(accelerator=selected)
        except Exception as exc:  # noqa: BLE001
            answers = [_error(exc)]
        for facts in answers:
            if facts:
                extra.setdefault(impl.plugin_name, {}).update(facts)
    return extra
