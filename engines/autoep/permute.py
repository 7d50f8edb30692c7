"""Moving routed rows between token order and expert order, with gathers in both directions.

Autograd's backward of ``index_select`` is an ``index_add_`` (a zero fill and an atomic
scatter; for the dispatch, each token's row takes k atomic adds). Every permutation here comes
with its inverse, so each backward is a gather: the dispatch's backward sums a token's k rows
with the op registry's ``gather_sum`` (the same op that combines the experts' results), with no
atomics and the same result each run.
"""

from __future__ import annotations

import torch
from polyaccel import ops


def inverse_permutation(perm: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``; ``ids`` is ``arange(perm.numel())`` where the caller keeps one (a launch
    less a call)."""
    inv = torch.empty_like(perm)
    inv[perm] = ids if ids is not None else torch.arange(perm.numel(), device=perm.device)
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
    slot) assignments): row j is ``x[order[j] // k]``. ``inverse`` is ``order``'s inverse, so
    ``inverse.view(T, k)`` names each token's k routed rows (the index ``ops.gather_sum`` takes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return ops.gather_sum(grad, inverse.view(-1, ctx.k)), None, None, None
