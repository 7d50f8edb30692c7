"""The example's one op builder: SwiGLU, ranked above the core reference on the host,
but only while the example accelerator is the selected one.

Any plugin may register builders for any device type. This one serves "cpu", which
every polyaccel user has; its ``compatible`` check keeps it out of their way unless
they chose the example accelerator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from polyaccel.ops import OpBuilder
from polyaccel.ops.reference import make_swiglu


def _forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    g, u, go = gate.float(), up.float(), grad_out.float()
    sig = torch.sigmoid(g)
    silu = g * sig
    # d silu(g)/dg = sig + silu * (1 - sig)
    d_gate = go * u * (sig + silu * (1 - sig))
    return d_gate.to(gate.dtype), (go * silu).to(up.dtype)


def _only_when_selected(accelerator) -> tuple[bool, str]:
    from .accelerator import ExampleAccelerator

    if isinstance(accelerator, ExampleAccelerator):
        return True, ""
    name = getattr(accelerator, "name", None)
    return False, f"serves only the 'example' accelerator (the cpu device type is served by {name!r})"


def builders() -> list[OpBuilder]:
    return [OpBuilder(
        op="swiglu", name="example_swiglu", device_types=("cpu",), loader=lambda: make_swiglu(_forward, _backward),
        kind="torch", priority=20, compatible=_only_when_selected,
        description="torch silu in fp32 with an explicit backward (example plugin)",
    )]
