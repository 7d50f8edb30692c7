"""Whether Triton kernels can run for an accelerator, and the convention for testing them on CPU.

Every Triton op builder of the cuda and rocm plugins uses :func:`triton_compatible` as its
``compatible`` check, so ``polyaccel.ops.explain(op)`` tells a user exactly why a Triton
builder was or was not chosen (triton missing, no usable GPU, interpreter mode, ...).

Testing convention (CPU, CI)
----------------------------
``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before any kernel module is imported. Under
the interpreter, tests call the kernel functions **directly on CPU tensors** (for example
``polyaccel.plugins.cuda.kernels.optimizers.fused_adam(params, ...)``), never through the op
registry: the registry serves device types, and on a CPU-only machine the ``cuda`` device
type has no usable accelerator, so :func:`triton_compatible` answers False there by design.
On a GPU the same functions are reached through the registry (``polyaccel.ops.fused_adam``).
Kernels are written so that the interpreter and the GPU run the same code: no
GPU-only intrinsics without an interpreter fallback. The interpreter truncates fp32->bf16
(instead of rounding), so bf16 comparisons need one bf16 ulp of slack.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: kernels run on the host through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def triton_import() -> tuple[bool, str]:
    """(ok, reason) for ``import triton`` (cached: importing is slow and the answer is fixed)."""
    try:
        triton = importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable", with the reason
        return False, f"triton is not importable ({type(exc).__name__}: {exc}); install polyaccel[cuda]"
    return True, f"triton {getattr(triton, '__version__', '?')}"


def interpreter_available() -> tuple[bool, str]:
    """(ok, reason) for running kernels on CPU tensors under ``TRITON_INTERPRET=1`` (tests)."""
    ok, why = triton_import()
    if not ok:
        return False, why
    if not interpreting():
        return False, "TRITON_INTERPRET is not set to 1; kernels on CPU tensors need the interpreter"
    return True, why


def _device_check(accelerator) -> tuple[bool, str]:
    """Whether the accelerator's own GPU is one Triton can compile for.

    An accelerator may answer for itself with ``triton_device_support() -> (ok, reason)``
    (the cuda plugin checks the compute capability, the rocm plugin the gfx architecture and
    Triton's AMD backend); otherwise a usable ``torch.cuda`` device is enough.
    """
    probe = accelerator.probe()
    if not probe.available:
        return False, f"{accelerator.name} is not usable here: {probe.reason}"
    if probe.device_count < 1:
        return False, f"{accelerator.name} reports no devices"
    if accelerator.is_emulated():
        return False, f"{accelerator.name} runs on an emulated runtime; Triton needs a real GPU"
    own = getattr(accelerator, "triton_device_support", None)
    if callable(own):
        return own()
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    return True, ""


def triton_compatible(accelerator) -> tuple[bool, str]:
    """(ok, reason): True only where triton imports and a CUDA or ROCm device is usable.

    ``accelerator`` is the accelerator serving the builder's device type (the registry passes
    None when no plugin can serve it, e.g. device type "cuda" on a CPU-only machine).
    """
    if accelerator is None:
        return False, "no usable accelerator serves this device type (no CUDA/ROCm GPU here)"
    if accelerator.device_type != "cuda":
        return False, (f"Triton builders serve torch device type 'cuda' (CUDA and ROCm); "
                       f"{accelerator.name} uses {accelerator.device_type!r}")
    ok, why = triton_import()
    if not ok:
        return False, why
    if interpreting():
        return False, ("TRITON_INTERPRET=1 is set: kernels would run in the slow CPU interpreter; "
                       "unset it to use the Triton builders on the GPU")
    try:
        ok, why = _device_check(accelerator)
    except Exception as exc:  # noqa: BLE001 - a broken runtime means "not usable", with the reason
        return False, f"querying the device failed ({type(exc).__name__}: {exc})"
    if not ok:
        return False, why
    return True, ""
