"""Byte tokenizer, the deterministic rank-sharded sampler and the offline model builder."""

import math

import pytest
import torch
from polyaccel.apps.train.data import VOCAB_SIZE, ByteTokenizer, TokenSampler, load_text
from polyaccel.apps.train.model import ModelSpec, build_model, count_parameters
from polyaccel.errors import ConfigError


def test_byte_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    text = "ZeRO über gloo — 零冗余 ✓"
    ids = tok.encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < VOCAB_SIZE
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_bundled_corpus_is_a_few_kb():
    text = load_text(None)
    assert 2_000 < len(text.encode("utf-8")) < 8_000


def _find_window(tokens, row):
    n = row.numel()
    return [s for s in range(tokens.numel() - n + 1) if torch.equal(tokens[s:s + n], row)]


def test_sampler_is_deterministic_and_rank_sharded():
    tokens = ByteTokenizer().encode(load_text(None))
    s = TokenSampler(tokens, seq_len=16, batch_size=3, seed=7)
    world = 2
    g = s.global_batch(step=4, micro_step=1, world_size=world)
    parts = [s.batch(4, 1, r, world) for r in range(world)]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), g.input_ids)
    assert parts[0].input_ids.shape == (3, 16)
    # same key -> same batch (a fresh sampler: no hidden state); other keys -> other batches
    again = TokenSampler(tokens, seq_len=16, batch_size=3, seed=7).batch(4, 1, 1, world)
    assert torch.equal(again.input_ids, parts[1].input_ids)
    for other in (s.batch(5, 1, 1, world), s.batch(4, 0, 1, world),
                  TokenSampler(tokens, 16, 3, seed=8).batch(4, 1, 1, world)):
        assert not torch.equal(other.input_ids, parts[1].input_ids)
    # every row is a contiguous window of the text, and labels are the inputs (HF shifts them)
    for row in g.input_ids:
        assert _find_window(tokens, row)
    assert torch.equal(g.labels, g.input_ids)


def test_sampler_errors_name_the_flag():
    tokens = torch.arange(10)
    with pytest.raises(ConfigError, match="--seq-len 20"):
        TokenSampler(tokens, 20, 2, 0)
    with pytest.raises(ConfigError, match="--batch-size 0"):
        TokenSampler(tokens, 4, 0, 0)
    with pytest.raises(ValueError, match="rank 2"):
        TokenSampler(tokens, 4, 1, 0).batch(0, 0, 2, 2)
    with pytest.raises(ConfigError, match="no such file"):
        load_text("/nonexistent/corpus.txt")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_models_build_offline_deterministically_without_dropout(name):
    spec = ModelSpec(name=name, hidden_size=32, num_layers=1, num_heads=2, max_positions=64)
    torch.manual_seed(3)
    a = build_model(spec)
    torch.manual_seed(3)
    b = build_model(spec)
    assert a.training
    assert count_parameters(a) == count_parameters(b) > 0
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    ids = torch.randint(0, VOCAB_SIZE, (2, 24))
    l1 = a(input_ids=ids, labels=ids).loss
    l2 = a(input_ids=ids, labels=ids).loss  # train mode: equal only because dropout is off
    assert torch.equal(l1, l2)
    assert abs(l1.item() - math.log(VOCAB_SIZE)) < 0.5  # a fresh model is near uniform


def test_model_spec_errors():
    with pytest.raises(ConfigError, match="--model 'bert'"):
        ModelSpec(name="bert").validate()
    with pytest.raises(ConfigError, match="not divisible by --heads 3"):
        ModelSpec(hidden_size=64, num_heads=3).validate()
    with pytest.raises(ConfigError, match="--layers 0"):
        ModelSpec(num_layers=0).validate()
