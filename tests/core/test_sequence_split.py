"""polyaccel.sequence.split_batch: the batch side of sequence parallelism, against an unsplit reference."""

import pytest
import torch
from polyaccel import InvalidArgument
from polyaccel.sequence import split_batch
from transformers.loss.loss_utils import ForCausalLMLoss


def _batch(B=3, L=12, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, L), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[-1, 7] = -100
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, :4] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_split_pieces_reassemble_the_shifted_batch(size):
    b = _batch()
    before = {k: v.clone() for k, v in b.items()}
    parts = [split_batch(b, rank=r, size=size) for r in range(size)]
    for k, v in before.items():
        assert torch.equal(b[k], v) and set(b) == set(before)
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), b["input_ids"])
    expected = torch.full_like(b["labels"], -100)
    expected[:, :-1] = b["labels"][:, 1:]
    got = torch.cat([p["labels"] for p in parts], 1)
    assert torch.equal(got, expected)
    assert all(p["shift_labels"] is p["labels"] for p in parts)
    assert all(int(p["num_items_in_batch"]) == int((expected != -100).sum()) for p in parts)
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1), torch.arange(12).expand(3, 12))
    assert all(p["attention_mask"] is b["attention_mask"] for p in parts)


def test_given_position_ids_kept_and_embeds_split():
    b = _batch(B=2, L=8)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]])
    emb = torch.randn(2, 8, 5)
    p = split_batch({"inputs_embeds": emb, "position_ids": pos, "labels": b["labels"][:, :8]}, rank=1, size=2)
    assert torch.equal(p["position_ids"], pos[:, 4:]) and torch.equal(p["inputs_embeds"], emb[:, 4:])
    assert "attention_mask" not in p


def test_sum_of_rank_losses_is_the_full_sequence_loss_in_transformers():
    b = _batch(B=2, L=16, V=13, seed=3)
    logits = torch.randn(2, 16, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    full = ForCausalLMLoss(logits, b["labels"], vocab_size=13)
    for size in (2, 4):
        total = 0
        for r in range(size):
            p = split_batch(b, rank=r, size=size)
            loc = logits[:, r * 16 // size:(r + 1) * 16 // size]
            total = total + ForCausalLMLoss(loc, p["labels"], vocab_size=13, shift_labels=p["shift_labels"],
                                            num_items_in_batch=p["num_items_in_batch"])
        torch.testing.assert_close(total, full.to(total.dtype), rtol=1e-6, atol=1e-6)


def test_refusals_name_the_numbers():
    b = _batch(L=12)
    with pytest.raises(InvalidArgument, match=r"12 is not divisible .* size 5 .*\[1, 2, 3, 4, 6, 12\]"):
        split_batch(b, rank=0, size=5)
    with pytest.raises(InvalidArgument, match="rank must be in"):
        split_batch(b, rank=2, size=2)
    with pytest.raises(InvalidArgument, match="pixel_values"):
        split_batch({**b, "pixel_values": torch.zeros(3, 3)}, rank=0, size=2)
    with pytest.raises(InvalidArgument, match="2-D"):
        split_batch({**b, "attention_mask": torch.ones(3, 1, 12, 12)}, rank=0, size=2)
    with pytest.raises(InvalidArgument, match="labels has shape"):
        split_batch({**b, "labels": b["labels"][:, :6]}, rank=0, size=2)
