"""The fused expert ops (``moe_gate_up``, ``moe_down_combine``) on ``torch._grouped_mm``: one autograd node each.

The device work is AutoEP's unfused chain's: ``torch._grouped_mm`` (CUTLASS) for the GEMMs, the
Triton SwiGLU and gather-sum passes around them, in the same order (only the dispatch's copy is
made by another kernel), so the numbers are that chain's bit for bit. What changes is the host's share: the chain is six
autograd nodes (dispatch, two grouped GEMMs, the gate/up split, SwiGLU, combine), each checking
its arguments, looked up in the registry and run through Python in backward; here each op is one
node with one check. A layer with few tokens a step is bound by that host work, not by the
device.

The dispatch is gather-sum's backward kernel writing each token row to its routed slots
(``routed[index[t, j]] = x[t]``: one pass, no index of each row's token to build). Saved for
backward, as the chain saves them: the routed rows (w1's gradient), the gate/up product (SwiGLU's
backward, let go as soon as that has run), ``h`` (w2's gradient) and the down product's rows where
the router weights need a gradient.

Inputs ``torch._grouped_mm`` does not take (not bf16, widths not multiples of 8, 2**31 rows) take
the unfused path through the op registry (``grouped_mm`` then ``swiglu``; ``grouped_mm`` then ``gather_sum``).

The host's share, per op: the arguments arrive checked (``polyaccel.ops.moe_gate_up`` /
``moe_down_combine`` check every call against the op's contract once, before any builder runs:
docs/plugin-authoring.md), so the builders do not check them again; the offsets' value check and
int32 copy are made once for the layer's two ops where the offsets are valid by construction
(:func:`prepared_offsets`).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from polyaccel import ops
from polyaccel.ops import offsets as known_offsets
from polyaccel.ops.reference.grouped_mm import last_offset
from polyaccel.ops.reference.moe_experts import routed_tokens

from .gather_sum import gather_sum_backward, gather_sum_forward
from .grouped_mm import (
    _capturing,
    checked_offsets,
    int32_offsets,
    torch_grouped_dgrad,
    torch_grouped_mm_applies,
    torch_grouped_product,
    torch_grouped_wgrad,
)
from .swiglu import swiglu_of_halves, swiglu_of_halves_backward


def unfused_gate_up(x, index, w1, offsets):
    """The unfused path through the op registry (its fastest plain builders): gather, grouped_mm, swiglu."""
    gate, up = ops.grouped_mm(x.index_select(0, routed_tokens(index)), w1, offsets).chunk(2, dim=-1)
    return ops.swiglu(gate, up)


class _RowsLike(NamedTuple):
    """What ``torch_grouped_mm_applies`` reads of the routed rows ``[N, H]`` (dtype, shape), without making them."""

    dtype: torch.dtype
    shape: tuple[int, int]


#: (weak reference to the offsets prepared last, their version counter, rows, (off64, last, off32))
_prepared: tuple = (None, -1, -1, None)


def prepared_offsets(offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, int | None, torch.Tensor]:
    """(int64 offsets, last offset, int32 offsets) for ``torch._grouped_mm`` over ``rows`` rows: what
    ``checked_offsets`` and ``int32_offsets`` give, made once for the two ops of a layer where the offsets are
    marked valid by construction (:mod:`polyaccel.ops.offsets`): the second op takes what the first made while
    they are still the marked ones for these rows, unchanged (version counter) and the same tensor. Any other
    offsets are read back, checked and converted at every call, and nothing is kept while capturing a graph."""
    global _prepared
    if _capturing(offsets):
        off64, last = checked_offsets(offsets, rows)
        return off64, last, int32_offsets(off64)
    ref, version, n, got = _prepared
    if (ref is not None and ref() is offsets and version == offsets._version and n == rows
            and known_offsets.known_last(offsets, rows) is not None):
        return got
    off64 = offsets.to(torch.int64)
    last = last_offset(off64, rows)  # (no read for marked offsets; else a read and the checks)
    off32 = off64.to(torch.int32)
    if off64 is offsets and known_offsets.known_last(offsets, rows) is not None:
        _prepared = (weakref.ref(offsets), offsets._version, rows, (off64, last, off32))
    return off64, last, off32


def scatter_to_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``routed [T*k, H]`` with ``routed[index[t, j]] = x[t]`` (gather-sum's backward kernel, unweighted)."""
    return gather_sum_backward(x.contiguous(), None, index, None, False)[0]


class _GateUp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, index, off32, off64, last):
        routed = scatter_to_slots(x, index)
        gu = torch_grouped_product(routed, w1, off32, off64, last)
        ctx.save_for_backward(routed, w1, index, off32, off64)
        # gu kept on ctx, not saved, so the backward lets it go once SwiGLU's gradient is taken (it is no
        # output, so this makes no reference cycle)
        ctx.gu, ctx.last = gu, last
        return swiglu_of_halves(gu)

    @staticmethod
    def backward(ctx, dh):
        routed, w1, index, off32, off64 = ctx.saved_tensors
        gu, ctx.gu = ctx.gu, None
        if gu is None:
            raise RuntimeError("moe_gate_up (torch_moe_gate_up): its backward already ran for this forward; "
                               "run the forward again instead of backward with retain_graph=True through it")
        d_gu = swiglu_of_halves_backward(dh, gu)  # (d_gate and d_up as the halves of one tensor)
        del gu
        dx = dw1 = None
        if ctx.needs_input_grad[1]:
            dw1 = torch_grouped_wgrad(routed, d_gu, w1, off32)
        if ctx.needs_input_grad[0]:
            dx = gather_sum_forward(torch_grouped_dgrad(d_gu, w1, off32, off64, ctx.last), index, None)
        return dx, dw1, None, None, None, None


class _DownCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w2, weights, index, off32, off64, last):
        y = torch_grouped_product(h, w2, off32, off64, last)
        need_d_weights = weights is not None and ctx.needs_input_grad[2]
        ctx.save_for_backward(h, w2, weights, index, off32, off64, y if need_d_weights else None)
        ctx.last = last
        return gather_sum_forward(y, index, weights)

    @staticmethod
    def backward(ctx, grad_out):
        h, w2, weights, index, off32, off64, y = ctx.saved_tensors
        d_y, d_weights = gather_sum_backward(grad_out.contiguous(), y, index, weights, y is not None)
        dh = dw2 = None
        if ctx.needs_input_grad[1]:
            dw2 = torch_grouped_wgrad(h, d_y, w2, off32)
        if ctx.needs_input_grad[0]:
            dh = torch_grouped_dgrad(d_y, w2, off32, off64, ctx.last)
        return dh, dw2, d_weights, None, None, None, None


def moe_gate_up(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The op as one autograd node (see the module docstring), else the unfused path through the registry.
    The arguments were checked against the op's contract by ``polyaccel.ops.moe_gate_up``."""
    rows = index.numel()
    if weight.shape[0] == 0 or not torch_grouped_mm_applies(_RowsLike(x.dtype, (rows, x.shape[1])), weight)[0]:
        return unfused_gate_up(x, index, weight, offsets)
    off64, last, off32 = prepared_offsets(offsets, rows)
    return _GateUp.apply(x, weight, index, off32, off64, last)


def moe_down_combine(h: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor,
                     weights: torch.Tensor | None = None) -> torch.Tensor:
    """The op as one autograd node (see the module docstring), else the unfused path through the registry.
    The arguments were checked against the op's contract by ``polyaccel.ops.moe_down_combine``."""
    if weight.shape[0] == 0 or not torch_grouped_mm_applies(h, weight)[0]:
        return ops.gather_sum(ops.grouped_mm(h, weight, offsets), index, weights)
    off64, last, off32 = prepared_offsets(offsets, h.shape[0])
    return _DownCombine.apply(h, weight, weights, index, off32, off64, last)
