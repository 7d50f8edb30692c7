"""Moving routed rows between token order and expert order, with gathers in both directions.

Autograd's backward of ``index_select`` is an ``index_add_`` (a zero fill and an atomic
scatter; for the dispatch, each token's row takes k atomic adds). Every permutation here comes
with its inverse, so each backward is a gather, and the dispatch's backward sums a token's k
rows with one reduction: fewer passes over the rows, no atomics, and the same result each run.
"""

from __future__ import annotations

import torch


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


class PermuteRows(torch.autograd.Function):
    """``x[perm]``; the backward gathers with ``inverse``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class DispatchRows(torch.autograd.Function):
    """Token rows ``x [T, H]`` to routed rows ``[T*k, H]`` in ``order`` (an order of the T*k (token,
    slot) assignments): row j is ``x[order[j] // k]``. ``inverse`` is ``order``'s inverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        per_slot = grad.index_select(0, inverse)  # (token, slot) order
        return _sum_slots(per_slot.view(-1, ctx.k, grad.shape[-1])), None, None, None


#: Up to this top-k the combine weights the slots one pass each; above it one batched product. On the H200
#: (``benchmarks/autoep_combine.py``, 32k tokens, H 2048) the batched product runs as a GEMV: 1.80 / 0.72 /
#: 0.76 ms at k = 1 / 2 / 3 against 0.17 / 0.36 / 0.55 ms slot by slot; from k = 4 the strided per-slot passes
#: lose (0.74 vs 0.65 ms; 1.51 vs 0.99 ms at k = 8).
_MAX_SLOTS_ONE_BY_ONE = 3


def _sum_slots(per_slot: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``per_slot [T, k, H]`` summed over k, each slot times its ``weights [T, k]`` column when given: up to
    ``_MAX_SLOTS_ONE_BY_ONE`` slots one element-wise pass each, above that one batched product (weighted) or one
    reduction. (The unweighted passes are not yet timed against the reduction over the middle dimension, which
    took 0.37 ms of run 3's 32k-token top-2 step: ``autoep_combine.py`` prints both.) ``per_slot`` must be a
    tensor of the caller's own: with one slot and no weights the result is a view of it."""
    k = per_slot.shape[1]
    if k > _MAX_SLOTS_ONE_BY_ONE:
        if weights is None:
            return per_slot.sum(dim=1)
        return torch.bmm(weights.unsqueeze(1), per_slot).squeeze(1)  # one read of the rows, no [T, k, H] product
    if weights is None:
        out = per_slot[:, 0] if k == 1 else per_slot[:, 0] + per_slot[:, 1]
        for j in range(2, k):
            out.add_(per_slot[:, j])
        return out
    out = per_slot[:, 0] * weights[:, :1]
    for j in range(1, k):
        out.addcmul_(per_slot[:, j], weights[:, j:j + 1])
    return out


class CombineRows(torch.autograd.Function):
    """Routed rows ``y [T*k, H]`` in ``order`` back to tokens: ``out[t] = sum_j w[t, j] * y[inverse[t*k + j]]``
    (``weights`` ``[T, k]`` in ``y``'s dtype, or None for a plain sum)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor | None, order: torch.Tensor, inverse: torch.Tensor,
                k: int) -> torch.Tensor:
        per_slot = y.index_select(0, inverse).view(-1, k, y.shape[-1])
        ctx.k = k
        needs_rows = weights is not None and ctx.needs_input_grad[1]
        ctx.save_for_backward(order, weights, per_slot if needs_rows else None)
        return _sum_slots(per_slot, weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        order, weights, per_slot = ctx.saved_tensors
        src = torch.div(order, ctx.k, rounding_mode="floor")
        d_y = grad.index_select(0, src)
        d_w = None
        if weights is not None:
            d_y.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(-1))
            if ctx.needs_input_grad[1]:
                d_w = torch.bmm(per_slot, grad.unsqueeze(-1)).squeeze(-1)
        return d_y, d_w, None, None, None
