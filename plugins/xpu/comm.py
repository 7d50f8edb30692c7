"""Which torch.distributed backend reaches Intel GPUs: xccl (native), else oneCCL's ccl, else none."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

ONECCL_MODULE = "oneccl_bindings_for_pytorch"


@dataclass(frozen=True)
class BackendChoice:
    backend: str | None
    reason: str


def choose_backend() -> BackendChoice:
    """``xccl`` where torch has it, else ``ccl`` when the oneCCL bindings import, else a reason.

    Importing the oneCCL bindings is what registers the ``ccl`` backend with torch.distributed,
    so the import is the check.
    """
    try:
        import torch.distributed as dist
    except Exception as exc:  # noqa: BLE001
        return BackendChoice(None, f"torch.distributed does not import: {exc}")
    if not dist.is_available():
        return BackendChoice(None, "this torch build has no torch.distributed")
    is_xccl = getattr(dist, "is_xccl_available", None)
    if is_xccl is not None and is_xccl():
        return BackendChoice("xccl", "torch.distributed provides xccl")
    no_xccl = ("this torch has no xccl backend (torch.distributed.is_xccl_available is missing)"
               if is_xccl is None else "torch.distributed.is_xccl_available() is False (torch built without XCCL)")
    try:
        mod = importlib.import_module(ONECCL_MODULE)
    except Exception as exc:  # noqa: BLE001 - a broken binding is just "not available"
        return BackendChoice(
            None,
            f"no collective backend for xpu: {no_xccl}, and {ONECCL_MODULE} does not import "
            f"({type(exc).__name__}: {exc}). Install a torch built with XCCL (torch>=2.8 XPU wheels) "
            f"or the oneCCL bindings matching this torch",
        )
    version = getattr(mod, "__version__", "unknown version")
    return BackendChoice("ccl", f"{no_xccl}; using the oneCCL bindings ({ONECCL_MODULE} {version})")
