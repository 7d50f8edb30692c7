"""Find the Ascend runtime (torch_npu on CANN) and say in words why it is not usable.

Detection asks the runtime, never the mere presence of the package: an installed
torch_npu whose CANN libraries are missing fails at import with
``ImportError: libhccl.so: cannot open shared object file``; that is "unavailable"
with the reason, not a crash and not a wrong selection. Nothing here runs at
``import polyaccel`` time; it runs when the plugin is probed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

import torch

#: ACL host-registration flags (acl_rt.h). MAPPED maps the pages for device DMA and needs a
#: 4096-byte aligned address and length; PINNED-only registration measured far slower H2D.
ACL_HOST_REG_MAPPED = 0x2
ACL_HOST_REG_PINNED = 0x10000000
HOST_REGISTER_ALIGNMENT = 4096

AUTOLOAD_HINT = (
    "if `import torch` itself fails with 'Failed to load the backend extension: torch_npu', set "
    "TORCH_DEVICE_BACKEND_AUTOLOAD=0 (or uninstall torch-npu on hosts without CANN)"
)


def import_torch_npu() -> tuple[Any | None, str]:
    """(torch_npu module, "") or (None, why it cannot be used)."""
    mod = sys.modules.get("torch_npu")
    if mod is None:
        try:
            if importlib.util.find_spec("torch_npu") is None:
                return None, "torch_npu is not installed (on an Ascend host with CANN: pip install polyaccel[npu])"
        except (ImportError, ValueError):
            pass  # found but broken: the import below says how
        try:
            mod = importlib.import_module("torch_npu")
        except ImportError as exc:
            return None, (
                f"torch_npu is installed but cannot be imported ({exc}); the CANN libraries are missing "
                f"or not on LD_LIBRARY_PATH (source CANN's set_env.sh); {AUTOLOAD_HINT}"
            )
        except Exception as exc:  # noqa: BLE001 - any import-time failure is a reason, not a crash
            return None, f"importing torch_npu failed with {type(exc).__name__}: {exc}; {AUTOLOAD_HINT}"
    if getattr(torch, "npu", None) is None:
        return None, "torch_npu imported but torch.npu is missing (torch_npu does not match this torch?)"
    return mod, ""


def npu_module():
    """``torch.npu`` (present only once torch_npu has been imported)."""
    return getattr(torch, "npu", None)


def npurt_binding() -> tuple[Any | None, str]:
    """(torch.npu.npurt() binding, "") or (None, why host registration is unavailable)."""
    npu = npu_module()
    if npu is None or not hasattr(npu, "npurt"):
        return None, ("torch.npu.npurt is unavailable in this torch_npu build, so host buffers cannot be "
                      "registered (npuHostRegister); buffers stay pageable; use pin_memory() copies instead")
    try:
        rt = npu.npurt()
    except RuntimeError as exc:
        return None, f"torch.npu.npurt() failed to initialise the NPU runtime: {exc}"
    missing = [n for n in ("npuHostRegister", "npuHostUnregister") if not hasattr(rt, n)]
    if missing:
        return None, f"torch.npu.npurt() lacks {', '.join(missing)}"
    return rt, ""
