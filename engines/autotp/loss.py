"""Cross-entropy over vocab-parallel logits, without ever forming the full logits on one rank.

Each rank holds the logits of its vocabulary rows, ``[N, V_r]``. Per token:

1. the row maximum: local max, all-reduce MAX (for stability only; it cancels in the gradient);
2. ``sum(exp(x - max))`` and the target's logit (from the rank that holds the target, zero
   elsewhere): one all-reduce SUM of a ``[2, N]`` tensor;
3. ``loss = log(sum) - (target_logit - max)``; the gradient is ``softmax - onehot`` on the local
   columns, kept from the forward (no communication in backward).

Per rank this allocates two ``[N, V_r]`` buffers at most (the upcast copy, turned in place into
the softmax), i.e. about ``1/tp`` of what ``F.cross_entropy`` on the full logits needs.
Computation is in float32 at least (float64 stays float64); tokens equal to ``ignore_index``
contribute nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from polyaccel import comm
from polyaccel.errors import InvalidArgument


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, ignore_index):
        n, v_local = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        x = logits.to(dtype)
        if x is logits:  # no upcast copy was made: do not touch the caller's logits
            x = x.clone()
        local_t = target - vocab_start
        here = (local_t >= 0) & (local_t < v_local)
        valid = target != ignore_index
        if v_local:
            m = x.max(dim=-1).values
        else:
            m = torch.full((n,), float("-inf"), dtype=dtype, device=x.device)
        comm.all_reduce(m, op=comm.ReduceOp.MAX, group=group)
        x.sub_(m.unsqueeze(1))
        stats = torch.zeros((2, n), dtype=dtype, device=x.device)
        idx = local_t.clamp(0, max(v_local - 1, 0))
        if v_local:
            stats[1] = x.gather(1, idx.unsqueeze(1)).squeeze(1) * here
            x.exp_()
            stats[0] = x.sum(dim=-1)
        comm.all_reduce(stats, group=group)
        loss = torch.log(stats[0]) - stats[1]
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        if v_local:
            x.div_(stats[0].unsqueeze(1))  # the local softmax, kept for backward
        ctx.save_for_backward(x, idx, here & valid, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, hit, valid = ctx.saved_tensors
        g = softmax  # reused in place: backward runs once
        if g.shape[1]:
            rows = torch.arange(g.shape[0], device=g.device)
            g[rows, idx] -= hit.to(g.dtype)
        g.mul_((grad * valid).unsqueeze(1).to(g.dtype))
        return g.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, group, vocab_start: int,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy of ``[..., V_r]`` vocab-parallel logits against full-vocabulary ``target`` ids.

    ``reduction``: ``"none"`` (per token, 0 where ignored), ``"sum"``, or ``"mean"`` over the tokens
    that are not ignored (``F.cross_entropy``'s rule); ``num_items_in_batch`` divides the sum instead.
    """
    if reduction not in ("mean", "sum", "none"):
        raise InvalidArgument(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    flat = logits.reshape(-1, logits.shape[-1])
    tgt = target.reshape(-1).to(flat.device)
    per_token = _VocabParallelCE.apply(flat, tgt, vocab_start, group, ignore_index)
    if reduction == "none":
        return per_token.view(target.shape)
    total = per_token.sum()
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    if reduction == "sum":
        return total
    return total / (tgt != ignore_index).sum()


def causal_lm_loss(fallback, head):
    """A Hugging Face ``loss_function`` that runs the vocab-parallel loss on the split logits
    ``head`` (a :class:`~.layers.VocabParallelLMHead`) just produced, and ``fallback`` (the
    model's own loss function) on whole ones."""

    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index: int = -100,
                      shift_labels=None, **kwargs):
        shard = head.take_local(logits)
        if shard is None:
            return fallback(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if shift_labels is None:
            padded = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:].contiguous()
        return vocab_parallel_cross_entropy(logits, shift_labels, group=shard.group, vocab_start=shard.vocab_start,
                                            ignore_index=ignore_index, num_items_in_batch=num_items_in_batch)

    loss_function.polyaccel_vocab_parallel = True
    return loss_function


__all__ = ["causal_lm_loss", "vocab_parallel_cross_entropy"]
