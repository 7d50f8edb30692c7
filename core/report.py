"""What `polyaccel report` knows: versions, every plugin with its status, capabilities, op choices."""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys
from typing import Any

from . import selection
from .discovery import SELECTED


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def build_report() -> dict[str, Any]:
    """A JSON-ready description of this installation (schema documented in docs/report.md)."""
    import torch

    ps = selection.plugins()
    selected = None
    selection_error = None
    try:
        selected = selection.get_accelerator()
    except Exception as exc:  # noqa: BLE001 - the report must describe a broken setup too
        selection_error = str(exc)

    out: dict[str, Any] = {
        "schema": 1,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "polyaccel": _version("polyaccel"),
            "pluggy": _version("pluggy"),
            "triton": _version("triton"),
        },
        "platform": {"system": platform.system(), "machine": platform.machine(), "executable": sys.executable},
        "plugins": [r.as_dict() for r in ps.records.values()],
        "selected": None,
        "selection_error": selection_error,
        "ops": {},
        "op_registration_errors": {},
        "extra": {},
    }
    from . import ops

    # plugins whose polyaccel_register_ops raised: isolated, with their dropped builders
    out["op_registration_errors"] = ops.registry.plugin_failures()
    if selected is not None:
        out["selected"] = {
            "name": selected.name,
            "device_type": selected.device_type,
            "capabilities": sorted(selected.capabilities()),
            "emulated": selected.is_emulated(),
            "communication_backend": selected.communication_backend,
        }
        try:
            from .comm.hooks import resolve_hooks

            out["selected"]["comm"] = resolve_hooks(selected, ps).as_dict()
        except Exception as exc:  # noqa: BLE001
            out["selected"]["comm"] = {"error": str(exc)}
        for op in ops.registry.ops():
            try:
                cands = ops.registry.candidates(op, selected.device_type)
                out["ops"][op] = {"device_type": selected.device_type,
                                  "candidates": [c.as_dict() for c in cands]}
            except Exception as exc:  # noqa: BLE001
                out["ops"][op] = {"device_type": selected.device_type, "error": str(exc)}
    for impl in ps.pm.hook.polyaccel_report.get_hookimpls():
        try:
            kw = {"accelerator": selected}
            extra = impl.function(*[kw[a] for a in impl.argnames])
        except Exception as exc:  # noqa: BLE001
            extra = {"error": f"{type(exc).__name__}: {exc}"}
        if extra:
            out["extra"][impl.plugin_name] = extra
    for rec in out["plugins"]:
        if rec["status"] == SELECTED:
            out["selected"]["plugin_source"] = rec["source"]
    return out
