"""Collectives inside autograd, for model layers that split activations over a group."""

from __future__ import annotations

import torch

from .collectives import all_reduce


class _SumGradOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # the incoming gradient is this node's alone (autograd hands each node its own buffer): reduced in place
        grad = grad.contiguous()
        all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` unchanged forward; its gradient summed over ``group`` backward (the ranks' gradients are partial:
    each used ``x`` for its own piece of a split weight)."""
    return _SumGradOver.apply(x, group)


__all__ = ["sum_grad_over"]
