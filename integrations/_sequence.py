"""Sequence parallelism (the ``sequence_parallel`` layer, AutoSP) in the trainers: what reaches the model.

The trainers shard their data over the batch ranks only (:func:`._engine.data_axis`), so the ranks of one
sequence group draw the same rows. Before the model, each rank's batch goes through
:func:`polyaccel.sequence.split_batch`: its contiguous part of every sequence, global positions, labels
shifted over the whole sequence and the whole batch's token count. Each rank's loss is then its tokens'
share of the whole sequence's loss; the sum over the sequence group is the loss of the whole sequence,
which is what the trainers report (:func:`whole_sequence_value`), while backward runs on the rank's share
(the engine sums the sequence ranks' gradients).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import ConfigError, PolyaccelError


def split_for_sequence(batch, rank: int, size: int) -> dict:
    """This sequence rank's part of ``batch`` (a mapping such as ``{"input_ids", "labels", "attention_mask"}``)."""
    from ..sequence import split_batch

    if not isinstance(batch, Mapping):
        raise ConfigError(f"sequence_parallel: the model gets this rank's part of every sequence, cut from a batch "
                          f"given as a mapping of tensors (input_ids, labels, attention_mask, position_ids); got a "
                          f"{type(batch).__name__}. Make the data loader yield dicts")
    return split_batch(batch, rank=rank, size=size)


def check_sequence_axis(engine, rank: int, size: int) -> None:
    """The engine's mesh must put this rank where the trainer will cut its batches: sequence rank ``rank`` of
    ``size`` (a mismatch would feed another rank's part of the sequence)."""
    mesh = getattr(engine, "mesh", None)
    got = (mesh.rank("sequence"), mesh.size("sequence")) if mesh is not None and size > 1 else (0, 1)
    if got != (rank, size):
        raise PolyaccelError(f"the trainer cuts its batches as sequence rank {rank} of {size}, but the engine's mesh "
                             f"puts this rank at sequence rank {got[0]} of {got[1]}")


def sequence_group(engine):
    """The engine's sequence-parallel process group and its size (``(None, 1)`` without one)."""
    mesh = getattr(engine, "mesh", None)
    if mesh is None or getattr(mesh, "sequence", 1) == 1:
        return None, 1
    return mesh.group("sequence"), mesh.size("sequence")


def whole_sequence_loss(loss: torch.Tensor, engine) -> torch.Tensor:
    """The sum of ``loss`` (detached) over the engine's sequence group: the loss of the whole sequence."""
    from .. import comm

    group, size = sequence_group(engine)
    total = loss.detach().clone()
    if size > 1:
        comm.all_reduce(total, group=group)
    return total


def whole_sequence_value(loss: torch.Tensor, engine) -> torch.Tensor:
    """``loss`` whose value is the whole sequence's loss and whose gradient is still this rank's share's."""
    group, size = sequence_group(engine)
    if size == 1 or not torch.is_tensor(loss):
        return loss
    return loss + (whole_sequence_loss(loss, engine) - loss.detach())
