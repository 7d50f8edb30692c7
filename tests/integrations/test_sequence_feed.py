"""How the trainers place a rank under sequence parallelism, and what they refuse, without starting ranks: the
batch and sequence axes of a global rank, a batch that is not a mapping, a mesh that disagrees, and the Trainer
settings that cannot give each rank its share of the whole sequence's loss."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from polyaccel.errors import ConfigError, PolyaccelError  # noqa: E402
from polyaccel.integrations._engine import data_axis, sequence_axis  # noqa: E402
from polyaccel.integrations._sequence import check_sequence_axis, split_for_sequence  # noqa: E402

TP_SP = {"tensor_parallel": {"autotp_size": 2}, "sequence_parallel": {"autosp_size": 2, "seq_dim": 1}}


def test_axes_of_a_rank_on_the_replica_expert_sequence_tensor_mesh():
    # 8 ranks = batch 2 x sequence 2 x tensor 2: tensor innermost, then sequence, then the batches
    assert [data_axis(TP_SP, r, 8) for r in range(8)] == [(0, 2)] * 4 + [(1, 2)] * 4
    assert [sequence_axis(TP_SP, r) for r in range(8)] == [(0, 2), (0, 2), (1, 2), (1, 2)] * 2
    assert sequence_axis({}, 5) == (0, 1) and data_axis({}, 5, 8) == (5, 8)
    with pytest.raises(ConfigError, match=r"tensor 2 x expert 1 x sequence 2 \(the config's tensor_parallel and "
                                          r"expert_parallel and sequence_parallel\) needs a multiple of 4 processes"):
        data_axis(TP_SP, 0, 6)


def test_a_batch_must_be_a_mapping_and_the_mesh_must_agree():
    with pytest.raises(ConfigError, match="got a Tensor. Make the data loader yield dicts"):
        split_for_sequence(torch.zeros(2, 4, dtype=torch.long), 0, 2)
    ids = torch.randint(0, 50, (2, 8))
    part = split_for_sequence({"input_ids": ids, "labels": ids}, 1, 2)
    assert torch.equal(part["input_ids"], ids[:, 4:]) and torch.equal(part["position_ids"][0], torch.arange(4, 8))

    mesh = SimpleNamespace(rank=lambda dim: 0, size=lambda dim: 2, sequence=2)
    check_sequence_axis(SimpleNamespace(mesh=mesh), 0, 2)
    with pytest.raises(PolyaccelError, match="cuts its batches as sequence rank 1 of 2, but the engine's mesh puts "
                                             "this rank at sequence rank 0 of 2"):
        check_sequence_axis(SimpleNamespace(mesh=mesh), 1, 2)


@pytest.mark.parametrize("changes, words", [
    ({"model_accepts_loss_kwargs": False}, "the model's forward must take loss keyword arguments"),
    ({"args": SimpleNamespace(average_tokens_across_devices=False)},
     "needs TrainingArguments(average_tokens_across_devices=True)"),
    ({"label_smoother": object()}, "label smoothing and compute_loss_func see the labels already shifted"),
    ({"compute_loss_func": len}, "label smoothing and compute_loss_func see the labels already shifted"),
])
def test_trainer_settings_that_cannot_give_a_share_of_the_loss_are_refused(changes, words):
    from polyaccel.integrations.transformers import PolyaccelTrainer

    fake = SimpleNamespace(_sp_size=2, model=torch.nn.Linear(1, 1), model_accepts_loss_kwargs=True,
                           args=SimpleNamespace(average_tokens_across_devices=True), label_smoother=None,
                           compute_loss_func=None)
    PolyaccelTrainer._check_sequence_parallel(fake)  # the settings that work
    for key, value in changes.items():
        setattr(fake, key, value)
    with pytest.raises(ConfigError, match="sequence_parallel") as exc:
        PolyaccelTrainer._check_sequence_parallel(fake)
    assert words in str(exc.value)
