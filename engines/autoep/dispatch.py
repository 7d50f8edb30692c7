"""Token dispatch over the expert-parallel group: the count exchange and the variable all-to-all.

Everything goes through ``polyaccel.comm`` (the plugin's backend); nothing here names one.
"""

from __future__ import annotations

import torch
from polyaccel import comm


class AllToAllV(torch.autograd.Function):
    """Variable-split ``all_to_all_single`` along dim 0; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        comm.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def exchange_counts(counts: torch.Tensor, ep: int, group) -> tuple[torch.Tensor, list[int], list[int]]:
    """One ``all_to_all_single`` of the per-expert counts.

    ``counts`` [E] are the assignments this rank routes to each global expert. Returns
    ``recv`` [ep, E_local] (``recv[s, e]``: rows source rank ``s`` sends to local expert ``e``),
    the rows this rank sends to each rank, and the rows it receives from each (one host sync).
    """
    recv = torch.empty_like(counts)
    comm.all_to_all_single(recv, counts, group=group)
    send_rows = counts.view(ep, -1).sum(1)
    recv = recv.view(ep, -1)
    both = torch.stack([send_rows, recv.sum(1)]).tolist()
    return recv, both[0], both[1]
