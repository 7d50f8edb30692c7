"""The contract checks of the Muon ops (``newton_schulz``, ``fused_muon``), run by their entry points.

The tensor-list rules are those of the other optimizer ops (:func:`.contract.check_optimizer_tensors`:
equal lengths and shapes, one device, dense floating tensors, no written tensor sharing memory),
with the lists ``params, grads, momentum_buffers`` of which the op writes the first and the last.
On top of them: every tensor is 2-D (Muon orthogonalizes matrices; other parameters belong to an
Adam, as ``MuonWithAuxAdam`` does), a gradient and its momentum buffer are both float64 or both not
(the momentum's one dtype), each head split fits its tensor, and the Newton-Schulz settings
are an int ``ns_steps`` in [0, 100), three finite coefficients and ``eps > 0``; ``newton_schulz``'s
``out`` matches ``x`` and is ``x`` itself or shares no memory with it. Every check runs
before any tensor is touched, so a refused call changes nothing.
"""

from __future__ import annotations

import math
import operator
from numbers import Real

import torch

from ..errors import OpArgumentError
from .contract import (
    _extent_bytes,
    _internally_overlaps,
    _shares_memory,
    check_beta,
    check_eps,
    check_lr,
    check_optimizer_tensors,
    check_weight_decay,
)
from .reference.muon import LR_ADJUSTMENTS, check_split

MUON_LISTS = ("params", "grads", "momentum_buffers")
#: the lists fused_muon writes: params and momentum_buffers
MUON_WRITTEN = frozenset((0, 2))
#: dtypes the iteration runs in
NS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
MAX_NS_STEPS = 100
_dtype = operator.attrgetter("dtype")


def check_ns_settings(op: str, steps, coefficients, eps, steps_name: str = "steps",
                      coefficients_name: str = "coefficients") -> None:
    """``steps`` an int in [0, 100); ``coefficients`` three finite real numbers; ``eps`` finite and > 0."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < MAX_NS_STEPS:
        raise OpArgumentError(f"{op}: {steps_name}={steps!r} is not allowed; {steps_name} must be an int in "
                              f"[0, {MAX_NS_STEPS}) (the Newton-Schulz iterations; 5 is usual)")
    ok = isinstance(coefficients, (tuple, list)) and len(coefficients) == 3 and all(
        isinstance(c, Real) and not isinstance(c, bool) and math.isfinite(float(c)) for c in coefficients)
    if not ok:
        raise OpArgumentError(f"{op}: {coefficients_name}={coefficients!r} is not allowed; {coefficients_name} must "
                              "be three finite numbers (a, b, c) of X <- a X + (b A + c A A) X, "
                              "e.g. (3.4445, -4.7750, 2.0315)")
    check_eps(op, eps)


def check_newton_schulz(x, *, steps, coefficients, eps, out=None) -> None:
    op = "newton_schulz"
    if not isinstance(x, torch.Tensor):
        raise OpArgumentError(f"{op}: x must be a tensor, got {type(x).__name__}")
    if x.layout != torch.strided or x.dtype not in NS_DTYPES:
        raise OpArgumentError(f"{op}: x is a {x.layout} tensor of dtype {x.dtype}; the op takes dense tensors of "
                              f"{', '.join(str(d).removeprefix('torch.') for d in NS_DTYPES)}")
    if x.dim() < 2:
        raise OpArgumentError(f"{op}: x must be a batch of matrices (..., m, n), got shape {tuple(x.shape)}")
    check_ns_settings(op, steps, coefficients, eps)
    if out is not None:
        check_ns_out(op, x, out)


def check_ns_out(op: str, x: torch.Tensor, out) -> None:
    """``out`` a strided tensor of ``x``'s shape, dtype and device, no two of its elements at one memory location,
    and either ``x`` itself (the same view) or sharing no memory with it."""
    if not isinstance(out, torch.Tensor) or out.layout != torch.strided:
        raise OpArgumentError(f"{op}: out must be None or a dense tensor, got "
                              f"{getattr(out, 'layout', type(out).__name__)}")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise OpArgumentError(f"{op}: out is {out.dtype}{tuple(out.shape)} on {out.device}, x is "
                              f"{x.dtype}{tuple(x.shape)} on {x.device}; out takes the result, so it must match x "
                              "in shape, dtype and device (or pass out=None for a new tensor)")
    if out.numel() == 0:
        return
    if not out.is_contiguous() and _internally_overlaps(out):
        raise OpArgumentError(f"{op}: out (shape {tuple(out.shape)}, strides {out.stride()}) has elements sharing "
                              "one memory location (an expanded or stride-0 view); pass a tensor that owns its memory")
    same_view = out.data_ptr() == x.data_ptr() and out.stride() == x.stride()
    start_x, start_o = x.data_ptr(), out.data_ptr()
    apart = start_x + _extent_bytes(x) <= start_o or start_o + _extent_bytes(out) <= start_x
    if not same_view and not apart and _shares_memory(x, out):
        raise OpArgumentError(f"{op}: out (strides {out.stride()}) shares memory with x (strides {x.stride()}) "
                              "without being the same view; pass out=x to write the result over x, or a tensor "
                              "of its own")


def check_momentum_dtypes(op: str, grads, momentum_buffers) -> None:
    """The momentum runs in one dtype per tensor: float64 when the gradient and its buffer are both float64, float32
    when neither is (16-bit ones are upcast); a float64 gradient with a float32 buffer (or the reverse) would need
    a rounding the op does not choose for the caller."""
    if torch.float64 not in set(map(_dtype, grads)) | set(map(_dtype, momentum_buffers)):
        return  # the common case: one set look-up per list
    for i, (g, buf) in enumerate(zip(grads, momentum_buffers, strict=True)):
        if (g.dtype == torch.float64) != (buf.dtype == torch.float64):
            raise OpArgumentError(
                f"{op}: grads[{i}] is {g.dtype} but momentum_buffers[{i}] is {buf.dtype}; the momentum is computed in "
                "float64 when both are float64 and in float32 otherwise, so a gradient and its buffer must both be "
                "float64 or both not (cast the gradient to the buffer's dtype, or keep the buffer in float64)")


def check_fused_muon(params, grads, momentum_buffers, *, lr, momentum, weight_decay, nesterov, ns_steps,
                     ns_coefficients, eps, ns_dtype, lr_adjustment, head_splits) -> None:
    op = "fused_muon"
    check_lr(op, lr)
    check_beta(op, momentum, "momentum")
    check_weight_decay(op, weight_decay)
    if not isinstance(nesterov, bool):
        raise OpArgumentError(f"{op}: nesterov must be True or False, got {nesterov!r}")
    check_ns_settings(op, ns_steps, ns_coefficients, eps, "ns_steps", "ns_coefficients")
    if ns_dtype not in NS_DTYPES:
        raise OpArgumentError(f"{op}: ns_dtype={ns_dtype!r} is not allowed; it must be one of "
                              f"{', '.join(map(str, NS_DTYPES))}")
    if lr_adjustment not in LR_ADJUSTMENTS:
        raise OpArgumentError(f"{op}: lr_adjustment={lr_adjustment!r} is not one of {LR_ADJUSTMENTS}")
    check_optimizer_tensors(op, MUON_LISTS, (params, grads, momentum_buffers), MUON_WRITTEN)
    check_momentum_dtypes(op, grads, momentum_buffers)
    for i, p in enumerate(params):
        if p.dim() != 2:
            raise OpArgumentError(f"{op}: params[{i}] has shape {tuple(p.shape)}; Muon steps 2-D matrices only "
                                  "(step other parameters with Adam, as MuonWithAuxAdam does)")
    if head_splits is not None:
        if not isinstance(head_splits, (list, tuple)) or len(head_splits) != len(params):
            count = len(head_splits) if isinstance(head_splits, (list, tuple)) else type(head_splits).__name__
            raise OpArgumentError(f"{op}: head_splits must be None or a list with one entry per param "
                                  f"({len(params)}), got {count}")
        for i, (p, split) in enumerate(zip(params, head_splits, strict=True)):
            check_split(op, i, p.shape, split)


__all__ = ["MUON_LISTS", "NS_DTYPES", "check_fused_muon", "check_momentum_dtypes", "check_newton_schulz",
           "check_ns_out", "check_ns_settings"]
