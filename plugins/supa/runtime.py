"""Find Biren's runtime (torch_supa) and say in words why it is not usable.

torch_supa presents parts of itself as ``torch.cuda`` (``torch.cuda.is_available()`` is
True on a SUPA machine), so SUPA is recognised by ``torch_supa`` / ``torch.supa`` itself,
never through ``torch.cuda``. Nothing here runs at ``import polyaccel`` time.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from polyaccel.vendor_extension import VendorExtension

#: supaHostRegister flags (CUDA-compatible numbering); DeepSpeed's supa backend registers with 0
SUPA_HOST_REGISTER_DEFAULT = 0x0


#: Biren's extension: torch_supa installs torch.supa
TORCH_SUPA = VendorExtension(
    module="torch_supa", torch_attr="supa", install_hint="on a Biren host: install Biren's torch_supa wheel",
    libraries="the Biren driver/runtime libraries are missing or not on LD_LIBRARY_PATH",
    device="SUPA device", visible_devices_env="SUPA_VISIBLE_DEVICES")


def supart_binding() -> tuple[Any | None, str]:
    """(torch.supa.supart() binding, "") or (None, why host registration is unavailable)."""
    return TORCH_SUPA.runtime_binding(
        "supart", ("supaHostRegister", "supaHostUnregister"),
        unavailable="torch.supa.supart is unavailable in this torch_supa build, so host buffers cannot be registered",
        failed="torch.supa.supart() failed")


def deepspeed_ops():
    """``torch.ops.deepspeed`` after importing torch_supa_ext.deepspeed (which registers the kernels), or None."""
    try:
        importlib.import_module("torch_supa_ext.deepspeed")
    except Exception:  # noqa: BLE001 - absent or broken extension: the reference serves the ops
        return None
    return getattr(torch.ops, "deepspeed", None)
