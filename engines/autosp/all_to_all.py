"""Ulysses' two exchanges, differentiable: sequence-sharded heads <-> head-sharded sequence.

``seq_to_heads`` takes tensors ``[batch, heads, seq/S, dim]`` (this rank's contiguous part of the
sequence, every local head) and returns ``[batch, heads/S, seq, dim]`` (the whole sequence, rank
``r``'s contiguous ``heads/S`` heads). Several tensors of the same batch, sequence and dim (q, k
and v, whose head counts may differ) travel in one all-to-all. ``heads_to_seq`` is the inverse for
the attention's output, laid out ``[batch, seq, heads/S, dim]`` as Hugging Face's attention
functions return it, giving ``[batch, seq/S, heads, dim]``.

An equal-split all-to-all sends chunk ``j`` to rank ``j``; its gradient sends the gradient of chunk
``i`` back to rank ``i``, which is the same exchange applied to the gradient. So each autograd
function's backward is the other direction's forward.
"""

from __future__ import annotations

import torch
from polyaccel import comm


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of ``send`` laid out ``[S, ...]`` (row ``j`` goes to rank ``j``) -> ``[S, ...]`` (row ``i``
    came from rank ``i``)."""
    send = send.contiguous()
    recv = torch.empty_like(send)  # of the contiguous send: empty_like keeps a view's strides
    comm.all_to_all_single(recv, send, group=group)
    return recv


def _pack_heads(tensors, size: int) -> torch.Tensor:
    """``[B, H_t, Ls, D]`` tensors -> ``[S, B, sum(H_t)/S, Ls, D]``: rank j's heads of every tensor, in order."""
    parts = []
    for t in tensors:
        b, h, ls, d = t.shape
        parts.append(t.reshape(b, size, h // size, ls, d).transpose(0, 1))
    return torch.cat(parts, dim=2)


def _unpack_seq(recv: torch.Tensor, heads: list[int], size: int) -> list[torch.Tensor]:
    """``[S, B, sum(H_t)/S, Ls, D]`` (row i: rank i's sequence part) -> ``[B, H_t/S, S*Ls, D]`` tensors."""
    out, start = [], 0
    s, b, _, ls, d = recv.shape
    for h in heads:
        piece = recv.narrow(2, start, h // size)  # [S, B, h/S, Ls, D]
        out.append(piece.permute(1, 2, 0, 3, 4).reshape(b, h // size, s * ls, d))
        start += h // size
    return out


def _pack_seq(t: torch.Tensor, size: int) -> torch.Tensor:
    """``[B, L, h, D]`` -> ``[S, B, L/S, h, D]``: sequence part j goes to rank j."""
    b, n, h, d = t.shape
    return t.reshape(b, size, n // size, h, d).transpose(0, 1)


def _unpack_heads(recv: torch.Tensor) -> torch.Tensor:
    """``[S, B, Ls, h, D]`` (row i: rank i's heads) -> ``[B, Ls, S*h, D]``."""
    s, b, ls, h, d = recv.shape
    return recv.permute(1, 2, 0, 3, 4).reshape(b, ls, s * h, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, size: int, *tensors):
        ctx.group, ctx.size = group, size
        ctx.heads = [t.shape[1] for t in tensors]
        return tuple(_unpack_seq(_exchange(_pack_heads(tensors, size), group), ctx.heads, size))

    @staticmethod
    def backward(ctx, *grads):
        size = ctx.size
        # the gradients arrive [B, H/S, L, D]: send sequence part i back to rank i, heads in the same order
        parts = []
        for g in grads:
            b, hl, n, d = g.shape
            parts.append(g.reshape(b, hl, size, n // size, d).permute(2, 0, 1, 3, 4))
        recv = _exchange(torch.cat(parts, dim=2), ctx.group)  # [S, B, sum H/S, Ls, D]; row j: heads of part j
        out, start = [], 0
        s, b, _, ls, d = recv.shape
        for h in ctx.heads:
            piece = recv.narrow(2, start, h // size)
            out.append(piece.transpose(0, 1).reshape(b, h, ls, d))
            start += h // size
        return (None, None, *out)


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, size: int, t: torch.Tensor):
        ctx.group, ctx.size = group, size
        return _unpack_heads(_exchange(_pack_seq(t, size), group))

    @staticmethod
    def backward(ctx, g):
        size = ctx.size
        b, ls, h, d = g.shape  # [B, Ls, H, D] -> heads part j to rank j
        send = g.reshape(b, ls, size, h // size, d).permute(2, 0, 1, 3, 4)
        recv = _exchange(send, ctx.group)  # [S, B, Ls, H/S, D]; row i: sequence part i
        return None, None, recv.transpose(0, 1).reshape(b, size * ls, h // size, d)


def seq_to_heads(tensors, *, group, size: int) -> list[torch.Tensor]:
    """``[B, H_t, L/S, D]`` each -> ``[B, H_t/S, L, D]`` each, in one all-to-all over ``group`` of ``size`` ranks."""
    return list(_SeqToHeads.apply(group, size, *tensors))


def heads_to_seq(t: torch.Tensor, *, group, size: int) -> torch.Tensor:
    """``[B, L, H/S, D]`` -> ``[B, L/S, H, D]``, over ``group`` of ``size`` ranks."""
    return _HeadsToSeq.apply(group, size, t)
