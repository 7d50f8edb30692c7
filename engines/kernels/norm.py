"""RMSNorm modules recognised by what they compute, and the forward that runs ``polyaccel.ops.rms_norm``.

A candidate is a module with one parameter, a 1-D ``weight``, no submodules, and its epsilon in one of
:data:`EPS_ATTRS`. It is recognised when its own class's ``forward``, run on a probe (a shallow copy
holding a fresh random weight), equals ``x * rsqrt(mean(x^2) + eps) * (offset + weight)`` for
``offset`` 0 (Llama's form) or 1 (Gemma's ``(1 + w)``), on rows of very different scales (so that the
epsilon, too, is the one read from the attribute). The probe never touches the model's own weight.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

#: attribute names Hugging Face's RMSNorm classes keep their epsilon under
EPS_ATTRS = ("variance_epsilon", "eps", "epsilon")
KERNEL_ATTR = "_polyaccel_kernel"


def eps_attr(module: nn.Module) -> str | None:
    for name in EPS_ATTRS:
        v = module.__dict__.get(name)
        if isinstance(v, float) and not isinstance(v, bool):
            return name
    return None


def is_candidate(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    w = params.get("weight")
    return (len(params) == 1 and w is not None and w.dim() == 1 and not module._modules
            and eps_attr(module) is not None)


def _expected(x, w, eps, offset):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w)


def probe_offset(module: nn.Module) -> tuple[float | None, str]:
    """(offset, "") when ``module`` computes RMSNorm with that weight offset, else (None, why not)."""
    eps = float(getattr(module, eps_attr(module)))
    g = torch.Generator().manual_seed(0)
    width = 16
    x = torch.randn(4, width, generator=g) * torch.tensor([[1.0], [1e-3], [30.0], [0.1]])
    probe = copy.copy(module)
    probe._parameters = {"weight": nn.Parameter(torch.randn(width, generator=g) * 0.5, requires_grad=False)}
    try:
        with torch.no_grad():
            y = type(module).forward(probe, x)
    except Exception as exc:  # noqa: BLE001 - what the probe cannot run is not recognised
        return None, f"its forward failed on a probe ({type(exc).__name__}: {exc})"
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None, "its forward does not return a tensor of its input's shape"
    w = probe._parameters["weight"]
    for offset in (0.0, 1.0):
        if torch.allclose(y.float(), _expected(x, w, eps, offset), rtol=1e-4, atol=1e-6):
            return offset, ""
    return None, "its forward is not x * rsqrt(mean(x^2) + eps) * (w or 1 + w) (probed)"


def call_original(module: nn.Module, original, *args, **kwargs):
    """The forward the module had before the swap: an instance ``forward`` it carried, else its class's."""
    if original is not None:
        return original(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def rms_norm_forward(module: nn.Module, original, eps_name: str, offset: float, x: torch.Tensor) -> torch.Tensor:
    """The swapped forward; a weight of another dtype than ``x`` keeps Hugging Face's forward (its result dtype
    follows type promotion, which the op, returning ``x``'s dtype, does not reproduce)."""
    from polyaccel import ops

    w = module.weight
    if w.dtype != x.dtype or x.dim() == 0 or x.shape[-1] != w.shape[0]:
        return call_original(module, original, x)
    return ops.rms_norm(x, w, getattr(module, eps_name), offset=offset)


def swap(module: nn.Module, offset: float) -> None:
    """Run the module through the op from now on (an instance ``forward``; class, parameters and hooks unchanged)."""
    original = module.__dict__.get("forward")
    module.forward = functools.partial(rms_norm_forward, module, original, eps_attr(module), offset)
    setattr(module, KERNEL_ATTR, "rms_norm")


__all__ = ["EPS_ATTRS", "KERNEL_ATTR", "call_original", "eps_attr", "is_candidate", "probe_offset", "rms_norm_forward",
           "swap"]
