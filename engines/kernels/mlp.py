"""Gated MLPs recognised by what they compute, and the forward that runs ``polyaccel.ops.swiglu``.

Two shapes: ``down_proj(act(gate_proj(x)) * up_proj(x))`` (Llama, Mistral, Qwen2/3, the dense MLPs of
Qwen3-MoE) and Phi-3's fused ``gate, up = gate_up_proj(x).chunk(2, -1); down_proj(up * act(gate))``.
A candidate has those submodules and its activation under ``act_fn`` or ``activation_fn``; it is
recognised when its own class's ``forward``, run on a probe (a shallow copy whose projections are small
random float64 linears with biases), equals the shape's formula with ``act = silu``. The projections
themselves are never replaced: the swapped forward calls the module's own ``gate_proj`` / ``up_proj`` /
``down_proj`` (AutoTP's split linears, ZeRO stage 3's gathered ones), only ``act(gate) * up`` becomes the
fused op.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

from .norm import KERNEL_ATTR, call_original

ACT_ATTRS = ("act_fn", "activation_fn")
SPLIT, FUSED = "gate_up_down", "gate_up_fused"
_SHAPES = {SPLIT: ("gate_proj", "up_proj", "down_proj"), FUSED: ("gate_up_proj", "down_proj")}


def shape_of(module: nn.Module) -> str | None:
    """Which gated-MLP shape ``module``'s submodules have (None: neither)."""
    children = module._modules
    if not any(a in module.__dict__ or a in children for a in ACT_ATTRS):
        return None
    for shape, names in _SHAPES.items():
        if all(isinstance(children.get(n), nn.Module) for n in names):
            return shape
    return None


def activation_name(module: nn.Module) -> str:
    for a in ACT_ATTRS:
        act = getattr(module, a, None)
        if act is not None:
            return type(act).__name__
    return "none"


def probe(module: nn.Module, shape: str) -> str:
    """"" when ``module``'s class computes the gated SiLU MLP of ``shape``, else why not."""
    g = torch.Generator().manual_seed(0)
    hidden, inner = 6, 5

    def linear(fin, fout):
        lin = nn.Linear(fin, fout, dtype=torch.float64)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(fout, fin, generator=g, dtype=torch.float64))
            lin.bias.copy_(torch.randn(fout, generator=g, dtype=torch.float64))
        return lin

    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    if shape == SPLIT:
        twin._modules.update(gate_proj=linear(hidden, inner), up_proj=linear(hidden, inner),
                             down_proj=linear(inner, hidden))
    else:
        twin._modules.update(gate_up_proj=linear(hidden, 2 * inner), down_proj=linear(inner, hidden))
    x = torch.randn(3, hidden, generator=g, dtype=torch.float64) * 2
    try:
        with torch.no_grad():
            y = type(module).forward(twin, x)
            want = _formula(twin, shape, x)
    except Exception as exc:  # noqa: BLE001 - what the probe cannot run is not recognised
        return f"its forward failed on a probe ({type(exc).__name__}: {exc})"
    if not isinstance(y, torch.Tensor) or y.shape != want.shape or not torch.allclose(y, want, rtol=1e-9,
                                                                                       atol=1e-12):
        return (f"its forward is not the gated SiLU MLP (probed; activation {activation_name(module)}: no fused "
                "kernel for it)")
    return ""


def _formula(m: nn.Module, shape: str, x: torch.Tensor) -> torch.Tensor:
    if shape == SPLIT:
        gate, up = m.gate_proj(x), m.up_proj(x)
    else:
        gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
    return m.down_proj(F.silu(gate) * up)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from polyaccel import ops

    width = gate.shape[-1]
    return ops.swiglu(gate.reshape(-1, width), up.reshape(-1, width)).view(gate.shape)


def gated_forward(module: nn.Module, original, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if args or kwargs:
        return call_original(module, original, x, *args, **kwargs)
    gate, up = module.gate_proj(x), module.up_proj(x)
    if gate.shape != up.shape or gate.dtype != up.dtype:  # not what the probe saw: Hugging Face's own forward
        return call_original(module, original, x)
    return module.down_proj(_swiglu(gate, up))


def fused_forward(module: nn.Module, original, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if args or kwargs:
        return call_original(module, original, x, *args, **kwargs)
    h = module.gate_up_proj(x)
    if h.shape[-1] % 2:
        return call_original(module, original, x)
    gate, up = h.chunk(2, dim=-1)
    return module.down_proj(_swiglu(gate, up))


def swap(module: nn.Module, shape: str) -> None:
    original = module.__dict__.get("forward")
    forward = gated_forward if shape == SPLIT else fused_forward
    module.forward = functools.partial(forward, module, original)
    setattr(module, KERNEL_ATTR, "swiglu")


__all__ = ["FUSED", "SPLIT", "activation_name", "fused_forward", "gated_forward", "probe", "shape_of", "swap"]
