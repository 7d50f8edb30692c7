"""Split one batch over the ranks of a sequence-parallel group (the batch side of AutoSP).

Every rank of a sequence group gets the same rows and keeps a contiguous ``1/size`` of each sequence, with
the global positions, the labels shifted over the whole sequence and the whole batch's token count, so that a
model running Ulysses attention over the group (the ``sequence_parallel`` layer) computes, summed over the
group's ranks, exactly the whole sequence's loss. What :func:`split_batch` does with each key, and what it
refuses: docs/autosp.md, "The batch".
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .errors import InvalidArgument

TOKEN_KEYS = ("input_ids", "inputs_embeds", "token_type_ids")
KNOWN_KEYS = TOKEN_KEYS + ("position_ids", "labels", "shift_labels", "attention_mask")


def valid_sizes(seq_len: int) -> list[int]:
    """The sequence-parallel sizes that divide ``seq_len``."""
    return [d for d in range(1, seq_len + 1) if seq_len % d == 0]


def check_divisible(seq_len: int, size: int) -> None:
    if seq_len % size:
        sizes = valid_sizes(seq_len)
        shown = sizes if len(sizes) <= 16 else sizes[:16] + ["..."]
        raise InvalidArgument(
            f"sequence length {seq_len} is not divisible by the sequence-parallel size {size} "
            f"({seq_len} % {size} = {seq_len % size}); valid sizes for this length: {shown}, "
            f"or pad the sequence to a multiple of {size}")


def shift_labels(labels: torch.Tensor, *, seq_dim: int = 1, ignore_index: int = -100) -> torch.Tensor:
    """Labels shifted left by one along ``seq_dim``; the last position gets ``ignore_index``."""
    last = labels.narrow(seq_dim, 0, 1).clone().fill_(ignore_index)
    return torch.cat([labels.narrow(seq_dim, 1, labels.shape[seq_dim] - 1), last], dim=seq_dim)


def split_batch(batch: Mapping, *, rank: int, size: int, seq_dim: int = 1, ignore_index: int = -100) -> dict:
    """This sequence rank's part of ``batch`` (the contract, key by key: docs/autosp.md, "The batch")."""
    _check_arguments(batch, size=size, rank=rank, seq_dim=seq_dim, ignore_index=ignore_index)
    ref, seq_dim, tok_shape = _tokens_of(batch, seq_dim)
    seq_len = tok_shape[seq_dim]
    check_divisible(seq_len, size)
    local = seq_len // size

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t.narrow(seq_dim, rank * local, local).contiguous()

    out = {k: v for k, v in batch.items() if not torch.is_tensor(v)}
    for key in TOKEN_KEYS:
        t = batch.get(key)
        if t is not None:
            extra = tuple(t.shape[seq_dim + 1:]) if key == "inputs_embeds" else ()
            _check_shape(key, t, tok_shape + extra)
            out[key] = cut(t)
    out["position_ids"] = cut(_global_positions(batch, ref, seq_dim, tok_shape))
    shifted = _shifted_labels(batch, seq_dim, tok_shape, ignore_index)
    if shifted is not None:
        out["labels"] = out["shift_labels"] = cut(shifted)
        out["num_items_in_batch"] = (shifted != ignore_index).sum()
    mask = batch.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2 or seq_dim != 1 or tuple(mask.shape) != tok_shape:
            raise InvalidArgument(
                f"split_batch keeps a 2-D [batch, seq] attention_mask whole; got shape {tuple(mask.shape)} "
                f"for tokens of shape {tok_shape} (seq_dim {seq_dim}). Pass the 2-D padding mask; the "
                f"sequence-parallel attention builds the full mask (causal, window, packing) itself")
        out["attention_mask"] = mask
    return out


def _check_arguments(batch, **ints: int) -> None:
    if not isinstance(batch, Mapping):
        raise InvalidArgument(f"split_batch needs a mapping (a dict of tensors), got {type(batch).__name__}")
    for name, v in ints.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgument(f"split_batch: {name} must be an int, got {v!r}")
    size, rank = ints["size"], ints["rank"]
    if size < 1:
        raise InvalidArgument(f"split_batch: size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise InvalidArgument(f"split_batch: rank must be in [0, {size}), got {rank}")
    unknown = [k for k, v in batch.items() if torch.is_tensor(v) and k not in KNOWN_KEYS]
    if unknown:
        raise InvalidArgument(
            f"split_batch does not know whether the tensors under {unknown} are per token; it splits "
            f"{list(TOKEN_KEYS)} and labels, keeps position_ids global and attention_mask whole. Remove them "
            f"or split them yourself")


def _tokens_of(batch: Mapping, seq_dim: int) -> tuple[torch.Tensor, int, tuple]:
    """(input_ids or inputs_embeds, seq_dim made non-negative, the shape of the tokens)."""
    ref_key = "input_ids" if batch.get("input_ids") is not None else "inputs_embeds"
    ref = batch.get(ref_key)
    if ref is None:
        raise InvalidArgument("split_batch needs input_ids or inputs_embeds in the batch")
    if not -ref.dim() <= seq_dim < ref.dim():
        raise InvalidArgument(f"split_batch: seq_dim {seq_dim} is out of range for {ref_key} of shape "
                              f"{tuple(ref.shape)}")
    seq_dim %= ref.dim()
    tok_shape = tuple(ref.shape[: seq_dim + 1]) if ref_key == "inputs_embeds" else tuple(ref.shape)
    return ref, seq_dim, tok_shape


def _check_shape(key: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != shape:
        raise InvalidArgument(f"split_batch: {key} has shape {tuple(t.shape)}, expected {shape} "
                              f"(the shape of the tokens)")


def _global_positions(batch: Mapping, ref: torch.Tensor, seq_dim: int, tok_shape: tuple) -> torch.Tensor:
    """The batch's position_ids (checked), or ``arange`` over the whole sequence for every row."""
    pos = batch.get("position_ids")
    if pos is not None:
        _check_shape("position_ids", pos, tok_shape)
        return pos
    view = [1] * len(tok_shape)
    view[seq_dim] = tok_shape[seq_dim]
    return torch.arange(tok_shape[seq_dim], device=ref.device).view(view).expand(tok_shape)


def _shifted_labels(batch: Mapping, seq_dim: int, tok_shape: tuple, ignore_index: int) -> torch.Tensor | None:
    """The labels shifted over the whole sequence (``shift_labels`` as given, else ``labels`` shifted)."""
    shifted = batch.get("shift_labels")
    if shifted is None and batch.get("labels") is not None:
        _check_shape("labels", batch["labels"], tok_shape)
        shifted = shift_labels(batch["labels"], seq_dim=seq_dim, ignore_index=ignore_index)
    if shifted is not None:
        _check_shape("shift_labels", shifted, tok_shape)
    return shifted
