"""Tensor-parallel layers: autograd functions over ``polyaccel.comm`` and the modules built on them.

The four communication patterns (all over the tensor group):

- :func:`copy_to_tp`: identity forward, all-reduce of the gradient backward (the input of a
  column-parallel layer: every rank computes a part of its gradient);
- :func:`reduce_from_tp`: all-reduce forward, identity backward (the output of a row-parallel
  layer, of a vocab-parallel embedding);
- :func:`gather_last_dim`: all-gather of uneven (and fused) pieces of the last dim forward, this
  rank's piece of the gradient backward;
- :func:`slice_last_dim`: this rank's piece forward, all-gather of the gradient backward.

Modules keep the parameter names and the storage orientation of what they replace (``weight`` and
``bias``; GPT-2's ``Conv1D`` keeps its ``[in, out]`` weight), so a state dict's keys do not change
and a rank's tensor is the piece :meth:`polyaccel.parallel.Split.piece` cuts from the full one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from polyaccel import comm
from polyaccel.comm.autograd import sum_grad_over
from polyaccel.parallel import Split
from torch import nn

# --------------------------------------------------------------------------------------------- functions


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # x is this layer's own fresh matmul output: reduced in place
        if x.is_contiguous():
            comm.all_reduce(x, group=group)
            ctx.mark_dirty(x)
            return x
        y = x.contiguous()
        comm.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather(x: torch.Tensor, group, split: Split) -> torch.Tensor:
    """The full last dim from every rank's piece (pieces may differ in length, including zero)."""
    tp = split.degree
    lengths = [split.local_length(r) for r in range(tp)]
    longest = max(lengths)
    xm = x.movedim(-1, 0)
    if xm.shape[0] < longest:
        pad = xm.new_zeros((longest - xm.shape[0], *xm.shape[1:]))
        xm = torch.cat([xm, pad], dim=0)
    xm = xm.contiguous()
    out = xm.new_empty((tp * longest, *xm.shape[1:]))
    comm.all_gather_into_tensor(out, xm, group=group)
    pieces = [out.narrow(0, r * longest, lengths[r]) for r in range(tp)]
    full = Split(split.dim, 0, split.sections, split.rank).assemble(pieces)
    return full.movedim(0, -1).contiguous()


def _piece(x: torch.Tensor, split: Split) -> torch.Tensor:
    return Split(split.dim, x.dim() - 1, split.sections, split.rank).piece(x).contiguous()


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, split):
        ctx.split = split
        return _gather(x, group, split)

    @staticmethod
    def backward(ctx, grad):
        return _piece(grad, ctx.split), None, None


class _SliceLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, split):
        ctx.group, ctx.split = group, split
        return _piece(x, split)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.split), None, None


def copy_to_tp(x, group):
    return sum_grad_over(x, group)


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group)


def gather_last_dim(x, group, split: Split):
    return _GatherLastDim.apply(x, group, split)


def slice_last_dim(x, group, split: Split):
    return _SliceLastDim.apply(x, group, split)


# --------------------------------------------------------------------------------------------- modules
class _TPBase(nn.Module):
    """Shared by the split layers: the group, this rank, the frozen split of the weight."""

    style = ""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, *, group, rank: int, split: Split,
                 kind: str, full_in: int, full_out: int):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.group = group
        self.tp_rank = rank
        self.split = split  # of the weight; sizes frozen here
        self.kind = kind  # "linear": weight [out, in]; "conv1d": weight [in, out]
        self.full_in_features, self.full_out_features = full_in, full_out
        w = weight.shape
        self.in_features, self.out_features = (w[0], w[1]) if kind == "conv1d" else (w[1], w[0])

    @property
    def partition_sizes(self) -> tuple[tuple[int, ...], ...]:
        return self.split.sections

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "conv1d":
            shape = (*x.shape[:-1], self.weight.shape[1])
            flat = x.reshape(-1, x.shape[-1])
            y = torch.addmm(bias, flat, self.weight) if bias is not None else flat @ self.weight
            return y.view(shape)
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        sizes = "+".join(str(s[self.tp_rank]) for s in self.split.sections)
        return (f"{self.kind}, in={self.full_in_features}, out={self.full_out_features}, rank {self.tp_rank} holds "
                f"{sizes} of {self.split.full_length} along weight dim {self.split.axis}, bias={self.bias is not None}")


class ColumnParallelLinear(_TPBase):
    """Output features split; the input gradient is all-reduced. ``gather_output`` returns the full output.

    ``copy_input=False`` leaves that all-reduce to the enclosing module (an attention whose q/k/v
    share one input): one collective instead of one per projection, and the same collective
    schedule on every rank, whatever the heads each holds."""

    style = "column"

    def __init__(self, *args, gather_output: bool = False, copy_input: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.gather_output = gather_output
        self.copy_input = copy_input  # False: the enclosing module's input went through copy_to_tp already
        self._out_split = Split(self.split.dim, 0, self.split.sections, self.split.rank)

    def forward(self, x):
        y = self._matmul(copy_to_tp(x, self.group) if self.copy_input else x, self.bias)
        if self.gather_output:
            y = gather_last_dim(y, self.group, self._out_split)
        return y


class RowParallelLinear(_TPBase):
    """Input features split; the output is all-reduced and the (whole) bias added once, after it.
    ``split_input``: the input arrives whole and each rank takes its piece."""

    style = "row"

    def __init__(self, *args, split_input: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.split_input = split_input
        self._in_split = Split(self.split.dim, 0, self.split.sections, self.split.rank)

    def forward(self, x):
        if self.split_input:
            x = slice_last_dim(x, self.group, self._in_split)
        y = reduce_from_tp(self._matmul(x, None), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows (the vocabulary) split: each rank looks up the ids it holds, zeros elsewhere, then all-reduce."""

    style = "vocab_embedding"

    def __init__(self, weight: nn.Parameter, *, group, rank: int, split: Split, num_embeddings: int,
                 padding_idx: int | None):
        super().__init__()
        self.weight = weight
        self.group = group
        self.tp_rank = rank
        self.split = split
        self.num_embeddings = num_embeddings
        self.embedding_dim = weight.shape[1]
        self.padding_idx = padding_idx
        sizes = split.sections[0]
        self.vocab_start = sum(sizes[:rank])
        self.vocab_end = self.vocab_start + sizes[rank]
        local_pad = None
        if padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end:
            local_pad = padding_idx - self.vocab_start
        self._local_padding_idx = local_pad

    def forward(self, ids):
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        if self.weight.shape[0] == 0:
            out = self.weight.new_zeros((*ids.shape, self.embedding_dim)) + 0 * self.weight.sum()
        else:
            out = F.embedding(local, self.weight, self._local_padding_idx)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rank {self.tp_rank} holds rows "
                f"[{self.vocab_start}, {self.vocab_end})")


class VocabShard:
    """What a split logits tensor carries so the vocab-parallel loss (and :func:`gather_logits`) can use it."""

    __slots__ = ("group", "split", "vocab_start", "vocab_size")

    def __init__(self, group, split: Split, vocab_start: int, vocab_size: int):
        self.group, self.split, self.vocab_start, self.vocab_size = group, split, vocab_start, vocab_size


SHARD_ATTR = "_polyaccel_vocab_shard"


def vocab_shard_of(t: torch.Tensor) -> VocabShard | None:
    return getattr(t, SHARD_ATTR, None)


class VocabParallelLMHead(_TPBase):
    """The lm_head with its rows (the vocabulary) split.

    Returns the full logits (gathered), except for the one call after :attr:`keep_local` is set
    (AutoTP sets it when the model is called with labels): then this rank's columns of the logits
    come back for the vocab-parallel cross-entropy (:attr:`local_pending` says so until the loss
    takes them), and the full logits never exist.
    """

    style = "vocab_head"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep_local = False
        self.local_pending = False
        sizes = self.split.sections[0]
        self.vocab_start = sum(sizes[: self.tp_rank])
        self._out_split = Split(self.split.dim, 0, self.split.sections, self.split.rank)
        self.shard = VocabShard(self.group, self._out_split, self.vocab_start, self.full_out_features)

    def forward(self, x):
        logits = self._matmul(copy_to_tp(x, self.group), self.bias)
        self.local_pending, self.keep_local = self.keep_local, False
        if self.local_pending:
            setattr(logits, SHARD_ATTR, self.shard)
            return logits
        return gather_last_dim(logits, self.group, self._out_split)

    def take_local(self, logits: torch.Tensor) -> VocabShard | None:
        """The shard info if ``logits`` are this head's pending split logits (consumed), else None."""
        if self.local_pending and logits.shape[-1] == self.out_features:
            self.local_pending = False
            return self.shard
        return None


def gather_logits(logits: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
    """Full logits from this rank's vocab-parallel piece (a no-op for logits that are whole).

    The piece is recognised by the tag the lm_head puts on it, or, when something in between
    returned a new tensor, by the width of ``model``'s vocab-parallel lm_head."""
    shard = vocab_shard_of(logits)
    if shard is None and model is not None:
        heads = [m for m in getattr(model, "module", model).modules() if isinstance(m, VocabParallelLMHead)]
        if heads and logits.shape[-1] == heads[0].out_features != heads[0].full_out_features:
            shard = heads[0].shard
    if shard is None:
        return logits
    return gather_last_dim(logits, shard.group, shard.split)


__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelLMHead", "VocabShard",
    "copy_to_tp", "gather_last_dim", "gather_logits", "reduce_from_tp", "slice_last_dim", "vocab_shard_of",
]
