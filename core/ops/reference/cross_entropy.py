"""The loss ops' references: cross-entropy of an LM head, log-probs, entropy and KL, vocab-parallel or not.

These materialise the ``[N, V_local]`` logits (they define the ops and are the tests' float64 oracle);
``polyaccel.ops.chunked_loss`` computes ``linear_cross_entropy`` without doing so.

Vocab-parallel form: with ``group``, each rank holds the columns ``[vocab_start, vocab_start + V_local)``
of the logits (the rows of the LM head). The row max is all-reduced (MAX, no gradient: logsumexp does
not depend on it), the sums of ``exp`` and the picked logits are all-reduced (SUM) by
:class:`AllReduceSum`, whose backward is the identity: every rank computes the same outputs, and
the gradient arriving for them is the same on every rank (each rank's loss is the same number), so
each rank's share of the gradient is the local one. That holds for the cross-entropy, whose
replicated logsumexp feeds only replicated values; ``logprobs``, ``entropy`` and ``kl`` write their
backward out instead (see ``_LogProbs`` below). Gradients stay with the shard: a rank's logits
(or LM-head rows) get their own gradient, and ``hidden`` gets the shard's part ``dlogits_local @ W_local``
(the caller sums it over the group, as a column-parallel LM head's input does in its backward).
"""

from __future__ import annotations

import torch

__all__ = ["AllReduceSum", "entropy", "kl", "linear_cross_entropy", "logprobs", "math_dtype"]


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 inputs, fp32 otherwise: the dtype of the ops' math and of their results."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class AllReduceSum(torch.autograd.Function):
    """``all_reduce(x, SUM)`` over ``group`` with the identity as backward (replicated downstream math)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        out = x.clone()
        all_reduce(out, group, dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_reduce(t: torch.Tensor, group, op) -> torch.Tensor:
    """In-place all-reduce of ``t`` over ``group``; through the host for a gloo group with device tensors."""
    import torch.distributed as dist

    if t.device.type != "cpu" and str(dist.get_backend(group)) == "gloo":
        host = t.cpu()
        dist.all_reduce(host, op=op, group=group)
        t.copy_(host)
    else:
        dist.all_reduce(t, op=op, group=group)
    return t


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else AllReduceSum.apply(x, group)


def _row_max(z: torch.Tensor, group) -> torch.Tensor:
    """The row max over the whole vocabulary, without a gradient."""
    m = z.detach().amax(-1)
    if group is not None:
        import torch.distributed as dist

        all_reduce(m, group, dist.ReduceOp.MAX)
    return m


def _logsumexp(z: torch.Tensor, group) -> torch.Tensor:
    m = _row_max(z, group)
    return m + torch.log(_sum(torch.exp(z - m.unsqueeze(-1)).sum(-1), group))


def _picked(z: torch.Tensor, labels: torch.Tensor, vocab_start: int, valid: torch.Tensor | None, group):
    """``z[label]`` per row over the whole vocabulary (0 where ``valid`` is False)."""
    local = labels - vocab_start
    mine = (local >= 0) & (local < z.shape[-1])
    if valid is not None:
        mine &= valid
    got = z.gather(-1, torch.where(mine, local, 0).unsqueeze(-1)).squeeze(-1)
    return _sum(torch.where(mine, got, torch.zeros_like(got)), group)


def _resolved_start(op: str, group, v_local: int, vocab_start, device) -> int:
    if group is None or vocab_start is not None:
        return int(vocab_start or 0)
    from ..contract_loss import vocab_shards

    return vocab_shards(op, group, v_local, None, device)[0]


def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean", z_loss=0.0,
                         num_items=None, group=None, vocab_start=None, chunk_size=None):
    """Cross-entropy of an LM head, `hidden @ weight.T (+ bias)`, without the caller materialising the logits.

    `hidden` is `[N, H]`, `weight` `[V_local, H]` (the LM head's rows; the whole vocabulary
    without a group), `bias` None or `[V_local]`, all of one floating dtype and device;
    `labels` is `[N]` int64, already shifted by the caller: each label is `ignore_index` or a
    class in `[0, V)`. Keyword-only arguments. With `z = hidden @ weight.T + bias` (computed
    in the input dtype, then fp32; fp64 for fp64 input) and `lse = logsumexp(z)` per row:

        loss = sum over rows with label != ignore_index of
               lse - z[label] + z_loss * lse ** 2

    divided by `num_items` when given (a count of tokens over the whole batch, e.g. a
    sequence-parallel group's: an int or a one-element tensor, > 0), else by the number of
    rows not ignored (`reduction="mean"`, 0 when every row is ignored); `reduction="sum"`
    returns the plain sum (with `num_items` None). The result is a 0-d fp32 tensor (fp64
    for fp64 input); gradients flow to `hidden`, `weight` and `bias` in their dtypes, zero
    for ignored rows. `chunk_size` (None or tokens > 0) is the token chunk of builders that
    compute it in chunks; it does not change the result.

    Vocab-parallel form: with `group` (a torch.distributed process group), `weight` holds
    rows `[vocab_start, vocab_start + V_local)` of the whole head; `vocab_start=None` takes
    the ranks' shards in rank order. The row max and the sums (of `exp`, of the picked
    logit) are all-reduced over the group, so every rank returns the whole loss.
    Gradients stay with the shard: `weight` (and `bias`) get their rows' gradient and
    `hidden` the shard's part, which the caller sums over the group (as a column-parallel
    LM head does for its input). The backward assumes every rank back-propagates the same
    gradient for the loss.

    This reference materialises the `[N, V_local]` logits; builders (the chunked torch
    one, Triton) must not.
    """
    start = _resolved_start("linear_cross_entropy", group, weight.shape[0], vocab_start, hidden.device)
    acc = math_dtype(hidden.dtype)
    z = torch.nn.functional.linear(hidden, weight, bias).to(acc)
    valid = labels != ignore_index
    lse = _logsumexp(z, group)
    per_row = lse - _picked(z, labels, start, valid, group)
    if z_loss:
        per_row = per_row + z_loss * lse * lse
    total = torch.where(valid, per_row, torch.zeros_like(per_row)).sum()
    if reduction == "sum":
        return total
    if num_items is not None:
        denom = num_items.to(acc) if isinstance(num_items, torch.Tensor) else float(num_items)
        return total / denom
    return total / valid.sum().clamp(min=1).to(acc)


def logprobs(logits, labels, *, group=None, vocab_start=None):
    """`log softmax(logits)[label]` per row: the log-probability of each label.

    `logits` is `[..., V_local]` floating (16-bit, fp32, fp64), `labels` `logits.shape[:-1]`
    int64 classes in `[0, V)`, on the logits' device. The result has `labels`' shape, in
    fp32 (fp64 for fp64 logits), computed in that dtype:
    `z[label] - logsumexp(z)`. Differentiable in `logits`: the gradient is
    `grad * (onehot(label) - softmax(z))`.

    Vocab-parallel: with `group`, `logits` are columns `[vocab_start, vocab_start + V_local)`
    of the whole vocabulary on this rank (`vocab_start=None`: the ranks' shards in rank
    order); the max, the sum of `exp` and the picked logit are all-reduced, every rank
    returns the whole result, and each rank's logits get their own columns' gradient (the
    backward assumes every rank back-propagates the same gradient for the result).
    """
    start = _resolved_start("logprobs", group, logits.shape[-1], vocab_start, logits.device)
    return _LogProbs.apply(logits, labels, start, group)


def entropy(logits, *, group=None):
    """The entropy of `softmax(logits)` per row, `-sum p log p` with `p = softmax(z)`.

    `logits` is `[..., V_local]` floating; the result is `logits.shape[:-1]` in fp32 (fp64
    for fp64 logits), computed in that dtype as `logsumexp(z) - sum(p * z)`. Differentiable
    in `logits`: the gradient is `grad * -p * (z - sum(p * z))`, i.e. `-p (log p + H)`.

    Vocab-parallel: with `group`, `logits` are this rank's columns of the whole vocabulary;
    the max and the sums are all-reduced, every rank returns the whole result and gets its
    own columns' gradient (the backward assumes every rank back-propagates the same
    gradient for the result).
    """
    return _Entropy.apply(logits, group)


def kl(logits_p, logits_q, *, group=None):
    """`KL(p || q)` per row, `sum p (log p - log q)` with `p = softmax(logits_p)`, `q = softmax(logits_q)`.

    `logits_p` and `logits_q` are `[..., V_local]` of one shape, floating dtype and device;
    the result is `logits_p.shape[:-1]` in fp32 (fp64 for fp64 logits), computed in that
    dtype as `sum(p * (zp - zq)) - logsumexp(zp) + logsumexp(zq)`. Differentiable in both:
    with `d = sum(p * (zp - zq))`, the gradients are `grad * p * (zp - zq - d)` for
    `logits_p` and `grad * (q - p)` for `logits_q`.

    Vocab-parallel: with `group`, both are this rank's columns of the whole vocabulary; the
    maxima and the sums are all-reduced, every rank returns the whole result and gets its
    own columns' gradients (the backward assumes every rank back-propagates the same
    gradient for the result).
    """
    return _KL.apply(logits_p, logits_q, group)


# ----------------------------------------------------------------------------- logits ops' autograd
# The logits ops' backward is written out: their softmax depends on the whole row's logsumexp, which a
# rank's local columns feed into only through the all-reduced sums, so autograd through the
# collectives would give each rank only its own columns' part of d/d lse. The closed forms below use
# row values every rank has (lse, the entropy, the KL) and the rank's own columns only; they save the
# logits and one or two floats per row, and recompute the softmax.
def _softmax(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return torch.exp(z - lse.unsqueeze(-1))


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):
        z = logits.to(math_dtype(logits.dtype))
        lse = _logsumexp(z, group)
        out = _picked(z, labels, vocab_start, None, group) - lse
        ctx.save_for_backward(logits, labels, lse)
        ctx.vocab_start = vocab_start
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, labels, lse = ctx.saved_tensors
        z = logits.to(lse.dtype)
        dz = -_softmax(z, lse) * grad.unsqueeze(-1)
        local = labels - ctx.vocab_start
        mine = (local >= 0) & (local < z.shape[-1])
        dz.scatter_add_(-1, torch.where(mine, local, 0).unsqueeze(-1),
                        torch.where(mine, grad, torch.zeros_like(grad)).unsqueeze(-1))
        return dz.to(logits.dtype), None, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, group):
        z = logits.to(math_dtype(logits.dtype))
        lse = _logsumexp(z, group)
        out = lse - _sum((_softmax(z, lse) * z).sum(-1), group)
        ctx.save_for_backward(logits, lse, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, lse, h = ctx.saved_tensors
        z = logits.to(lse.dtype)
        # d H / d z = -p (log p + H), log p = z - lse
        dz = -_softmax(z, lse) * (z - (lse - h).unsqueeze(-1)) * grad.unsqueeze(-1)
        return dz.to(logits.dtype), None


class _KL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_p, logits_q, group):
        acc = math_dtype(logits_p.dtype)
        zp, zq = logits_p.to(acc), logits_q.to(acc)
        lse_p, lse_q = _logsumexp(zp, group), _logsumexp(zq, group)
        d = _sum((_softmax(zp, lse_p) * (zp - zq)).sum(-1), group)
        ctx.save_for_backward(logits_p, logits_q, lse_p, lse_q, d)
        return d - lse_p + lse_q

    @staticmethod
    def backward(ctx, grad):
        logits_p, logits_q, lse_p, lse_q, d = ctx.saved_tensors
        zp, zq = logits_p.to(d.dtype), logits_q.to(d.dtype)
        p, g = _softmax(zp, lse_p), grad.unsqueeze(-1)
        dzp = g * p * (zp - zq - d.unsqueeze(-1)) if ctx.needs_input_grad[0] else None
        dzq = g * (_softmax(zq, lse_q) - p) if ctx.needs_input_grad[1] else None
        return (None if dzp is None else dzp.to(logits_p.dtype), None if dzq is None else dzq.to(logits_q.dtype),
                None)
