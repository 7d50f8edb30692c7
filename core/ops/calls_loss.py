"""The loss ops' entry points: ``linear_cross_entropy``, ``logprobs``, ``entropy``, ``kl``.

Each checks its call against the contract (:mod:`.contract_loss`), which also resolves the shard's
``vocab_start`` of a vocab-parallel call, then hands the call to the builder the registry picks
for the tensors' device type. Semantics: :mod:`polyaccel.ops.reference.cross_entropy`.
"""

from __future__ import annotations

import torch

from ..runtime import current
from . import contract_loss

#: the process's runtime; its op registry is read per call
_RUNTIME = current()


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, bias=None,
                         ignore_index=-100, reduction="mean", z_loss=0.0, num_items=None, group=None,
                         vocab_start=None, chunk_size=None) -> torch.Tensor:
    """``linear_cross_entropy`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.linear_cross_entropy` (docs/plugin-authoring.md).
    """
    start = contract_loss.check_linear_cross_entropy(
        hidden, weight, labels, bias=bias, ignore_index=ignore_index, reduction=reduction, z_loss=z_loss,
        num_items=num_items, group=group, vocab_start=vocab_start, chunk_size=chunk_size)
    return _RUNTIME.ops.resolve("linear_cross_entropy", hidden.device.type)(
        hidden, weight, labels, bias=bias, ignore_index=ignore_index, reduction=reduction, z_loss=float(z_loss),
        num_items=num_items, group=group, vocab_start=None if group is None else start, chunk_size=chunk_size)


def logprobs(logits: torch.Tensor, labels: torch.Tensor, *, group=None, vocab_start=None) -> torch.Tensor:
    """``logprobs`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.logprobs` (docs/plugin-authoring.md).
    """
    start = contract_loss.check_logprobs(logits, labels, group=group, vocab_start=vocab_start)
    return _RUNTIME.ops.resolve("logprobs", logits.device.type)(
        logits, labels, group=group, vocab_start=None if group is None else start)


def entropy(logits: torch.Tensor, *, group=None) -> torch.Tensor:
    """``entropy`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.entropy` (docs/plugin-authoring.md).
    """
    contract_loss.check_entropy(logits, group=group)
    return _RUNTIME.ops.resolve("entropy", logits.device.type)(logits, group=group)


def kl(logits_p: torch.Tensor, logits_q: torch.Tensor, *, group=None) -> torch.Tensor:
    """``kl`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.kl` (docs/plugin-authoring.md).
    """
    contract_loss.check_kl(logits_p, logits_q, group=group)
    return _RUNTIME.ops.resolve("kl", logits_p.device.type)(logits_p, logits_q, group=group)


__all__ = ["entropy", "kl", "linear_cross_entropy", "logprobs"]
