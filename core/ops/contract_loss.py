"""The contract of the loss ops: ``linear_cross_entropy``, ``logprobs``, ``entropy``, ``kl``.

What ``polyaccel.ops.<op>`` checks before any builder runs (every builder then sees only calls the
contract allows, and a bad call fails the same way on every device):

* tensors: ``hidden`` ``[N, H]`` and ``weight`` ``[V_local, H]`` of one floating dtype on one device,
  ``bias`` None or ``[V_local]`` of that dtype and device, ``labels`` ``[N]`` int64 on that device;
  logits ``[..., V_local]`` floating (``kl``'s two of one shape and dtype), labels ``logits.shape[:-1]``;
* values: every label is ``ignore_index`` or in ``[0, V)``, ``V`` the whole vocabulary (the sum of the
  ranks' ``V_local`` with a group). Reading the labels costs one device synchronisation per call; a label
  out of range would otherwise give a wrong loss silently (or an illegal memory access in a kernel);
* hyperparameters: ``z_loss`` a finite number >= 0, ``reduction`` "mean" or "sum", ``num_items`` None or
  a count > 0 (an int, or a one-element tensor: HF passes ``num_items_in_batch`` as one) and only with
  "mean", ``chunk_size`` None or an int > 0, ``ignore_index`` an int;
* the vocabulary split: without ``group``, ``vocab_start`` is None or 0; with one, the ranks' shards
  ``[vocab_start, vocab_start + V_local)`` tile ``[0, V)`` with neither gap nor overlap (one all-gather of
  two integers; ``vocab_start=None`` takes the shards in rank order).

:func:`check_linear_cross_entropy` and the others return the shard's ``vocab_start`` (0 without a group),
so the entry point hands builders a resolved value and they need no collective of their own for it.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

from ..errors import OpArgumentError

REDUCTIONS = ("mean", "sum")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ----------------------------------------------------------------------------- the vocabulary split
def _group_device(group, device: torch.device) -> torch.device:
    """Where a collective of ``group`` takes its tensors: the host for gloo, else ``device``."""
    import torch.distributed as dist

    backend = dist.get_backend(group)
    return torch.device("cpu") if str(backend) == "gloo" else device


def vocab_shards(op: str, group, v_local: int, vocab_start, device: torch.device, rows: int = 0) -> tuple[int, int]:
    """(this shard's vocab_start, the whole vocabulary V), checked; without a group: (0, v_local).

    ``rows``: the call's row count, which must be the same on every rank (the builders run one collective per
    chunk of rows; ranks with other counts would wait for each other forever).
    """
    if vocab_start is not None and (isinstance(vocab_start, bool) or not isinstance(vocab_start, Integral)):
        raise OpArgumentError(f"{op}: vocab_start must be an int or None, got {type(vocab_start).__name__}")
    if group is None:
        if vocab_start not in (None, 0):
            raise OpArgumentError(f"{op}: vocab_start={vocab_start} without a group; a shard of the vocabulary "
                                  "needs the tensor-parallel group it is split over (pass group=...)")
        return 0, v_local
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise OpArgumentError(f"{op}: group is given but torch.distributed is not initialized")
    world = dist.get_world_size(group)
    mine = torch.tensor([-1 if vocab_start is None else int(vocab_start), v_local, rows], dtype=torch.int64,
                        device=_group_device(group, device))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    triples = [tuple(int(v) for v in t.tolist()) for t in gathered]
    if len({n for _, _, n in triples}) > 1:
        raise OpArgumentError(f"{op}: the ranks of the group pass different numbers of rows "
                              f"({[n for _, _, n in triples]}); a vocab-parallel call takes the same tokens on "
                              "every rank (only the vocabulary is split)")
    pairs = _shard_starts(op, [(s, v) for s, v, _ in triples])
    return pairs[dist.get_rank(group)][0], _tiled_vocabulary(op, pairs)


def _shard_starts(op: str, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Every rank's (vocab_start, V_local): as given by all ranks, or (given by none) in rank order."""
    given = [s >= 0 for s, _ in pairs]
    if any(given) and not all(given):
        raise OpArgumentError(f"{op}: some ranks of the group pass vocab_start and others None "
                              f"(shards (vocab_start, V_local) per rank: {pairs}); pass it on all or on none")
    if all(given):
        return pairs
    starts = [sum(v for _, v in pairs[:r]) for r in range(len(pairs))]
    return [(s, v) for s, (_, v) in zip(starts, pairs, strict=True)]


def _tiled_vocabulary(op: str, pairs: list[tuple[int, int]]) -> int:
    """The whole vocabulary V the shards tile without gap or overlap (else an error naming where)."""
    end = 0
    for s, v in sorted(pairs):
        if s != end:
            raise OpArgumentError(f"{op}: the ranks' vocabulary shards (vocab_start, V_local) = {pairs} do not tile "
                                  f"[0, V): a {'gap' if s > end else 'overlap'} at {min(s, end)}; each rank's "
                                  "vocab_start is the sum of the V_local of the shards before it")
        end = s + v
    return end


# ----------------------------------------------------------------------------- pieces
def _tensor(op: str, name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise OpArgumentError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise OpArgumentError(f"{op}: {name} is a {t.layout} tensor; pass a dense (strided) one")
    return t


def _floating(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise OpArgumentError(f"{op}: {name} has dtype {t.dtype}; the op takes float32, bfloat16, float16 or "
                              "float64")


def _same_device(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise OpArgumentError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; pass tensors of "
                              "one device")


def _labels(op: str, labels, shape: tuple, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    labels = _tensor(op, "labels", labels)
    if labels.dtype != torch.int64:
        raise OpArgumentError(f"{op}: labels have dtype {labels.dtype}; pass int64 class indices "
                              "(labels.long())")
    if tuple(labels.shape) != tuple(shape):
        raise OpArgumentError(f"{op}: labels have shape {tuple(labels.shape)} but {ref_name} needs {tuple(shape)} "
                              "(one label per row)")
    _same_device(op, "labels", labels, ref_name, ref)
    return labels


def _check_label_range(op: str, labels: torch.Tensor, vocab: int, ignore_index: int | None) -> None:
    if not labels.numel():
        return
    bad = (labels < 0) | (labels >= vocab)
    if ignore_index is not None:
        bad &= labels != ignore_index
    if bool(bad.any()):  # one synchronisation; names the first bad label only then
        i = int(bad.reshape(-1).nonzero()[0])
        allowed = f"in [0, {vocab})" + (f" or ignore_index={ignore_index}" if ignore_index is not None else "")
        raise OpArgumentError(f"{op}: labels[{i}] = {int(labels.reshape(-1)[i])} is not a class of the "
                              f"vocabulary; every label must be {allowed}")


def _int(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise OpArgumentError(f"{op}: {name} must be an int, got {type(value).__name__}")
    return int(value)


def _check_num_items(op: str, num_items, reduction: str, device: torch.device) -> None:
    if num_items is None:
        return
    if reduction != "mean":
        raise OpArgumentError(f"{op}: num_items={num_items!r} with reduction={reduction!r}; num_items divides the "
                              "summed loss (reduction='mean'): pass one or the other")
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.dtype == torch.bool or num_items.dtype.is_complex:
            raise OpArgumentError(f"{op}: num_items must be a number or a one-element tensor, got "
                                  f"{num_items.dtype}{tuple(num_items.shape)}")
        if num_items.device.type != "cpu" and num_items.device != device:
            raise OpArgumentError(f"{op}: num_items is on {num_items.device} but the inputs are on {device}")
        value = float(num_items.item())
    elif isinstance(num_items, Real) and not isinstance(num_items, bool):
        value = float(num_items)
    else:
        raise OpArgumentError(f"{op}: num_items must be a number or a one-element tensor, got "
                              f"{type(num_items).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise OpArgumentError(f"{op}: num_items={value!r} is not allowed; it is the count of tokens the loss is "
                              "averaged over (over the whole batch / sequence-parallel group): a number > 0")


# ----------------------------------------------------------------------------- per op
def check_linear_cross_entropy(hidden, weight, labels, *, bias, ignore_index, reduction, z_loss, num_items, group,
                               vocab_start, chunk_size) -> int:
    """Validate a ``linear_cross_entropy`` call; returns this shard's vocab_start (0 without a group)."""
    op = "linear_cross_entropy"
    hidden, weight = _tensor(op, "hidden", hidden), _tensor(op, "weight", weight)
    if hidden.dim() != 2:
        raise OpArgumentError(f"{op}: hidden must be 2-D [N, H], got shape {tuple(hidden.shape)}; flatten the "
                              "tokens first (hidden.reshape(-1, H), labels.reshape(-1))")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise OpArgumentError(f"{op}: weight must be [V_local, H] with H = {hidden.shape[1]} (hidden's last "
                              f"dimension), got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise OpArgumentError(f"{op}: weight has no rows (V_local = 0); every shard of the vocabulary needs >= 1 row")
    _floating(op, "hidden", hidden)
    if weight.dtype != hidden.dtype:
        raise OpArgumentError(f"{op}: weight is {weight.dtype} but hidden is {hidden.dtype}; pass one dtype")
    _same_device(op, "weight", weight, "hidden", hidden)
    if bias is not None:
        bias = _tensor(op, "bias", bias)
        if tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype:
            raise OpArgumentError(f"{op}: bias must be [V_local] = [{weight.shape[0]}] of weight's dtype "
                                  f"{weight.dtype}, got {bias.dtype}{tuple(bias.shape)}")
        _same_device(op, "bias", bias, "hidden", hidden)
    labels = _labels(op, labels, (hidden.shape[0],), "hidden", hidden)
    ignore_index = _int(op, "ignore_index", ignore_index)
    if reduction not in REDUCTIONS:
        raise OpArgumentError(f"{op}: reduction={reduction!r} is not allowed; reduction must be one of {REDUCTIONS}")
    if isinstance(z_loss, bool) or not isinstance(z_loss, Real) or not (math.isfinite(z_loss) and z_loss >= 0):
        raise OpArgumentError(f"{op}: z_loss={z_loss!r} is not allowed; z_loss must be a finite number >= 0 "
                              "(the weight of logsumexp(z)^2; 0 turns it off)")
    _check_num_items(op, num_items, reduction, hidden.device)
    if chunk_size is not None and _int(op, "chunk_size", chunk_size) <= 0:
        raise OpArgumentError(f"{op}: chunk_size={chunk_size} is not allowed; chunk_size must be None (chosen from "
                              "N and V) or a number of tokens > 0")
    start, vocab = vocab_shards(op, group, weight.shape[0], vocab_start, hidden.device, hidden.shape[0])
    _check_label_range(op, labels, vocab, ignore_index)
    return start


def _check_logits(op: str, name: str, logits) -> torch.Tensor:
    logits = _tensor(op, name, logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise OpArgumentError(f"{op}: {name} must be [..., V_local] with V_local >= 1, got shape "
                              f"{tuple(logits.shape)}")
    _floating(op, name, logits)
    return logits


def check_logprobs(logits, labels, *, group, vocab_start) -> int:
    """Validate a ``logprobs`` call; returns this shard's vocab_start (0 without a group)."""
    op = "logprobs"
    logits = _check_logits(op, "logits", logits)
    labels = _labels(op, labels, tuple(logits.shape[:-1]), "logits", logits)
    start, vocab = vocab_shards(op, group, logits.shape[-1], vocab_start, logits.device, labels.numel())
    _check_label_range(op, labels, vocab, None)
    return start


def _check_group(op: str, group) -> None:
    if group is None:
        return
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise OpArgumentError(f"{op}: group is given but torch.distributed is not initialized")


def check_entropy(logits, *, group) -> None:
    op = "entropy"
    _check_logits(op, "logits", logits)
    _check_group(op, group)


def check_kl(logits_p, logits_q, *, group) -> None:
    op = "kl"
    p, q = _check_logits(op, "logits_p", logits_p), _check_logits(op, "logits_q", logits_q)
    if p.shape != q.shape or p.dtype != q.dtype:
        raise OpArgumentError(f"{op}: logits_p is {p.dtype}{tuple(p.shape)} but logits_q is {q.dtype}"
                              f"{tuple(q.shape)}; pass one shape and dtype")
    _same_device(op, "logits_q", q, "logits_p", p)
    _check_group(op, group)


__all__ = ["check_entropy", "check_kl", "check_linear_cross_entropy", "check_logprobs", "vocab_shards"]
