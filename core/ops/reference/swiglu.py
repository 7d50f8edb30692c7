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
    caller that split ``h`` may then hand back the whole gradient without concatenating. Found
    from the layout alone (``up`` starts F elements after ``gate`` in one storage, rows 2F apart),
    so a split of a view (``h.view(N, 2F)`` of a wider projection) counts too; the tensor returned
    views that storage.
    """
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        return None
    N, F = gate.shape
    if not F or gate.stride() != (2 * F, 1) or up.stride() != (2 * F, 1):
        return None
    if (gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()
            or up.data_ptr() != gate.data_ptr() + F * gate.element_size()):
        return None
    return gate.as_strided((N, 2 * F), (2 * F, 1))


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


# ------------------------------------------------------------------------- weighted_swiglu
def check_weighted_swiglu_args(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor) -> None:
    check_swiglu_args(gate, up)
    if gate.dim() != 2:
        raise OpArgumentError(f"weighted_swiglu: gate and up must be 2-D [rows, F], got {tuple(gate.shape)}")
    if weights.dim() != 1 or weights.shape[0] != gate.shape[0] or not weights.is_floating_point():
        raise OpArgumentError(f"weighted_swiglu: weights must be a 1-D floating-point tensor of one weight per row "
                              f"({gate.shape[0]}), got {weights.dtype}{tuple(weights.shape)}")
    if weights.device != gate.device:
        raise OpArgumentError(f"weighted_swiglu: weights are on {weights.device} but gate is on {gate.device}")


def weighted_swiglu_forward(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    g = upcast(gate)
    return (g * torch.sigmoid(g) * upcast(up) * upcast(weights).unsqueeze(1)).to(gate.dtype)


def weighted_swiglu_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor,
                             need_d_weights: bool):
    """Return (d_gate, d_up, d_weights or None) for ``out = silu(gate) * up * weights[:, None]``."""
    g, u, go, w = upcast(gate), upcast(up), upcast(grad_out), upcast(weights).unsqueeze(1)
    sig = torch.sigmoid(g)
    silu = g * sig
    gw = go * w
    d_gate = gw * u * sig * (1 + g * (1 - sig))
    d_up = gw * silu
    d_weights = (go * silu * u).sum(dim=1).to(weights.dtype) if need_d_weights else None
    return d_gate.to(gate.dtype), d_up.to(up.dtype), d_weights


def make_weighted_swiglu(forward, backward):
    """Build an autograd-aware weighted_swiglu op from a forward and a backward kernel.

    ``forward(gate, up, weights) -> out`` and ``backward(grad_out, gate, up, weights, need_d_weights)
    -> (d_gate, d_up, d_weights or None)`` compute the reference's math (:func:`weighted_swiglu_forward`,
    :func:`weighted_swiglu_backward`) any way they like; ``grad_out`` arrives contiguous. The returned
    ``weighted_swiglu(gate, up, weights)`` checks its arguments and saves the inputs for backward.
    """

    class _WeightedSwiGLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gate, up, weights):
            ctx.save_for_backward(gate, up, weights)
            return forward(gate, up, weights)

        @staticmethod
        def backward(ctx, grad_out):
            gate, up, weights = ctx.saved_tensors
            return backward(grad_out.contiguous(), gate, up, weights, ctx.needs_input_grad[2])

    def weighted_swiglu(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        check_weighted_swiglu_args(gate, up, weights)
        return _WeightedSwiGLU.apply(gate, up, weights)

    return weighted_swiglu


weighted_swiglu = make_weighted_swiglu(weighted_swiglu_forward, weighted_swiglu_backward)
weighted_swiglu.__doc__ = """SwiGLU with one weight per row, `silu(gate) * up * weights[:, None]`; differentiable.

    Called as `fn(gate, up, weights)`: `gate` and `up` are `[N, F]` of one dtype and device,
    floating point; `weights` is `[N]`, floating point (any float dtype), on that device.
    The result is `[N, F]` in `gate`'s dtype; math in fp32 for 16-bit inputs. With
    `sig = sigmoid(gate)` and `w = weights[:, None]`:

        out       = gate * sig * up * w
        d_gate    = grad_out * w * up * sig * (1 + gate * (1 - sig))
        d_up      = grad_out * w * gate * sig
        d_weights = sum over F of grad_out * gate * sig * up        (in `weights`' dtype)

    What it is for: a MoE layer whose every token goes to every expert (top-k equal to the
    number of experts) is a dense MLP whose hidden rows are scaled by the router weights;
    this op applies them without a pass of their own. As for `swiglu`, where `gate` and
    `up` are the two halves of one contiguous `[N, 2F]` tensor a builder may return
    `d_gate` and `d_up` as the halves of one new `[N, 2F]` tensor (`halves_of`).

    Build a builder's function with `make_weighted_swiglu(forward, backward)` (from
    `polyaccel.ops.reference`): it supplies the argument checks and the autograd wiring.
    """
