"""Find Biren's runtime (torch_supa) and say in words why it is not usable.

torch_supa presents parts of itself as ``torch.cuda`` (``torch.cuda.is_available()`` is
True on a SUPA machine), so SUPA is recognised by ``torch_supa`` / ``torch.supa`` itself,
never through ``torch.cuda``. Nothing here runs at ``import polyaccel`` time.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

import torch

#: supaHostRegister flags (CUDA-compatible numbering); DeepSpeed's supa backend registers with 0
SUPA_HOST_REGISTER_DEFAULT = 0x0


def import_torch_supa() -> tuple[Any | None, str]:
    """(torch_supa module, "") or (None, why it cannot be used)."""
    mod = sys.modules.get("torch_supa")
    if mod is None:
        try:
            if importlib.util.find_spec("torch_supa") is None:
                return None, "torch_supa is not installed (on a Biren host: install Biren's torch_supa wheel)"
        except (ImportError, ValueError):
            pass
        try:
            mod = importlib.import_module("torch_supa")
        except ImportError as exc:
            return None, (f"torch_supa is installed but cannot be imported ({exc}); the Biren driver/runtime "
                          "libraries are missing or not on LD_LIBRARY_PATH")
        except Exception as exc:  # noqa: BLE001 - an import-time failure is a reason, not a crash
            return None, f"importing torch_supa failed with {type(exc).__name__}: {exc}"
    if getattr(torch, "supa", None) is None:
        return None, "torch_supa imported but torch.supa is missing (torch_supa does not match this torch?)"
    return mod, ""


def supa_module():
    return getattr(torch, "supa", None)


def supart_binding() -> tuple[Any | None, str]:
    """(torch.supa.supart() binding, "") or (None, why host registration is unavailable)."""
    supa = supa_module()
    if supa is None or not hasattr(supa, "supart"):
        return None, "torch.supa.supart is unavailable in this torch_supa build, so host buffers cannot be registered"
    try:
        rt = supa.supart()
    except RuntimeError as exc:
        return None, f"torch.supa.supart() failed: {exc}"
    missing = [n for n in ("supaHostRegister", "supaHostUnregister") if not hasattr(rt, n)]
    if missing:
        return None, f"torch.supa.supart() lacks {', '.join(missing)}"
    return rt, ""


def deepspeed_ops():
    """``torch.ops.deepspeed`` after importing torch_supa_ext.deepspeed (which registers the kernels), or None."""
    try:
        importlib.import_module("torch_supa_ext.deepspeed")
    except Exception:  # noqa: BLE001 - absent or broken extension: the reference serves the ops
        return None
    return getattr(torch.ops, "deepspeed", None)
