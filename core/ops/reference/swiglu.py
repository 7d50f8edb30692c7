"""SwiGLU: ``silu(gate) * up``, with the explicit backward builders must match."""

from __future__ import annotations

import torch

from ...errors import OpArgumentError
from .optimizers import upcast


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = upcast(gate)
    return (g * torch.sigmoid(g) * upcast(up)).to(gate.dtype)


def swiglu_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """Return (d_gate, d_up) for ``out = silu(gate) * up``."""
    g, u, go = upcast(gate), upcast(up), upcast(grad_out)
    sig = torch.sigmoid(g)
    silu = g * sig
    d_gate = go * u * sig * (1 + g * (1 - sig))
    d_up = go * silu
    return d_gate.to(gate.dtype), d_up.to(up.dtype)


def halves_of(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """The contiguous ``[N, 2F]`` tensor whose ``chunk(2, -1)`` gave ``gate`` and ``up``; None if they are not.

    A swiglu builder may return its two gradients this way (the halves of one new tensor), and a
    caller that split ``h`` may then hand back the whole gradient without concatenating.
    """
    base = gate._base
    if gate.dim() != 2 or base is None or up._base is not base or base.dim() != 2 or not base.is_contiguous():
        return None
    F = gate.shape[1]
    if base.shape[1] != 2 * F or gate.shape != up.shape or gate.shape[0] != base.shape[0]:
        return None
    if gate.data_ptr() != base.data_ptr() or up.data_ptr() != base.data_ptr() + F * base.element_size():
        return None
    return base


def check_swiglu_args(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise OpArgumentError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if gate.dtype != up.dtype:
        raise OpArgumentError(f"swiglu: gate is {gate.dtype} but up is {up.dtype}; pass the same dtype")
    if gate.device != up.device:
        raise OpArgumentError(f"swiglu: gate is on {gate.device} but up is on {up.device}")
    if not gate.is_floating_point():
        raise OpArgumentError(f"swiglu: needs floating-point inputs, got {gate.dtype}")


def make_swiglu(forward, backward):
    """Build an autograd-aware swiglu op from a forward and a backward kernel.

    ``forward(gate, up) -> out`` and ``backward(grad_out, gate, up) -> (d_gate, d_up)``
    compute the reference's math (:func:`swiglu_forward`, :func:`swiglu_backward`) any way
    they like. The returned ``swiglu(gate, up)`` checks its arguments, saves the inputs
    for backward and is what a swiglu builder's loader returns.
    """

    class _SwiGLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gate, up):
            ctx.save_for_backward(gate, up)
            return forward(gate, up)

        @staticmethod
        def backward(ctx, grad_out):
            gate, up = ctx.saved_tensors
            return backward(grad_out.contiguous(), gate, up)

    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        check_swiglu_args(gate, up)
        return _SwiGLU.apply(gate, up)

    return swiglu


swiglu = make_swiglu(swiglu_forward, swiglu_backward)
swiglu.__doc__ = """SwiGLU, `silu(gate) * up`, differentiable; returns a new tensor.

    Called as `fn(gate, up)`: two tensors of one shape, dtype and device, floating point
    (zero-size allowed). The result has that shape and dtype; math in fp32 for 16-bit
    inputs. Gradients flow to both inputs, with `sig = sigmoid(gate)`:

        out    = gate * sig * up
        d_gate = grad_out * up * sig * (1 + gate * (1 - sig))
        d_up   = grad_out * gate * sig

    Where `gate` and `up` are the two halves of one contiguous `[N, 2F]` tensor (what
    `h.chunk(2, -1)` gives), a builder may return `d_gate` and `d_up` as the halves of one
    new `[N, 2F]` tensor, so that the caller needs no concatenation for `h`'s gradient
    (`halves_of(d_gate, d_up)` in `polyaccel.ops.reference.swiglu` finds that tensor).

    Build a builder's function with `make_swiglu(forward, backward)` (from
    `polyaccel.ops.reference`): it supplies the argument checks and the autograd wiring.
    """
