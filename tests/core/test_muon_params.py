"""choose_muon_params: which parameters Muon steps and their head splits, on real HF classes and plain torch."""

import pytest
import torch
from polyaccel.muon_params import MuonChoice, MuonParamsError, choose_muon_params
from torch import nn

transformers = pytest.importorskip("transformers")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"])
    return Qwen3NextForCausalLM(cfg)


def test_llama_gqa_rule_and_head_splits():
    model = _llama()
    choices = choose_muon_params(model, per_head=True)
    assert list(choices) == [n for n, _ in model.named_parameters()]
    attn = "model.layers.1.self_attn."
    assert choices[attn + "q_proj.weight"].head_split == (0, 4)
    assert choices[attn + "k_proj.weight"].head_split == (0, 2)  # GQA: the key-value heads
    assert choices[attn + "v_proj.weight"].head_split == (0, 2)
    assert choices[attn + "o_proj.weight"].head_split == (1, 4)
    assert choices["model.layers.0.mlp.down_proj.weight"] == MuonChoice(True, None, choices[
        "model.layers.0.mlp.down_proj.weight"].reason)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert not choices[name].muon and choices[name].head_split is None, name
    muon = {n for n, c in choices.items() if c.muon}
    assert muon == {n for n, p in model.named_parameters() if p.dim() == 2 and "layers" in n}
    # without per_head: the same parameters, whole
    plain = choose_muon_params(model)
    assert {n for n, c in plain.items() if c.muon} == muon
    assert all(c.head_split is None for c in plain.values())


def test_gpt2_conv1d_layout_and_tied_head():
    model = _gpt2()
    choices = choose_muon_params(model, per_head=True)
    # Conv1D stores (in, out): the fused q|k|v heads are column blocks, the output projection's row blocks
    assert choices["transformer.h.0.attn.c_attn.weight"].head_split == (1, 12)
    assert choices["transformer.h.0.attn.c_proj.weight"].head_split == (0, 4)
    assert choices["transformer.h.0.mlp.c_fc.weight"].muon
    assert choices["transformer.h.0.mlp.c_fc.weight"].head_split is None
    assert not choices["transformer.wte.weight"].muon and not choices["transformer.wpe.weight"].muon
    assert "lm_head.weight" not in choices  # tied to wte: one parameter, stepped by Adam
    # each column block of c_attn is one head's q (then k, then v): the block GPT2Attention reads
    w = model.transformer.h[0].attn.c_attn.weight
    from polyaccel.ops.reference.muon import split_heads

    blocks = split_heads(w, (1, 12))
    torch.testing.assert_close(blocks[5], w[:, 40:48])  # head 1 of k (heads of 8 columns; k starts at 32)


def test_qwen3_next_linear_attention_geometry():
    model = _qwen3_next()
    choices = choose_muon_params(model, per_head=True)
    lin = "model.layers.0.linear_attn."
    assert choices[lin + "in_proj_qkvz.weight"].head_split == (0, 2)  # per key head: q, k, v, z of its group
    assert choices[lin + "out_proj.weight"].head_split == (1, 4)      # value heads
    assert choices[lin + "in_proj_ba.weight"].head_split is None
    assert not choices[lin + "conv1d.weight"].muon and not choices[lin + "A_log"].muon
    full = "model.layers.1.self_attn."
    assert choices[full + "q_proj.weight"].head_split == (0, 4)  # gated query: 2 * head_dim rows a head
    assert choices[full + "k_proj.weight"].head_split == (0, 2)
    assert not choices["model.layers.0.mlp.gate.weight"].muon      # the router is no linear layer
    assert not choices["model.layers.0.mlp.experts.gate_up_proj"].muon  # 3-D expert bank
    assert not choices["model.layers.0.mlp.shared_expert_gate.weight"].muon  # (1, hidden): a vector


class _Attention(nn.Module):
    def __init__(self, hidden=24, heads=3, kv_heads=1):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 24)
        self.attn = _Attention()
        self.norm = nn.LayerNorm(24)
        self.mlp = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 24))
        self.head = nn.Linear(24, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


def test_plain_torch_model_rule_overrides_and_errors():
    model = _Plain()
    choices = choose_muon_params(model, per_head=True)
    assert choices["attn.k_proj.weight"].head_split == (0, 1) and choices["attn.o_proj.weight"].head_split == (1, 3)
    assert not choices["attn.q_proj.bias"].muon and not choices["embed.weight"].muon
    assert "head.weight" not in choices  # tied: named once, as the embedding
    assert choices["mlp.0.weight"].muon and choices["mlp.2.weight"].muon

    forced = choose_muon_params(model, muon=["embed.*"], adam=["mlp.2.*"])
    assert forced["embed.weight"].muon and "muon='embed.*'" in forced["embed.weight"].reason
    assert not forced["mlp.2.weight"].muon and forced["mlp.0.weight"].muon

    with pytest.raises(MuonParamsError, match=r"muon='blocks\.\*' matches no parameter"):
        choose_muon_params(model, muon=["blocks.*"])
    with pytest.raises(MuonParamsError, match=r"forces parameter 'norm.weight' of shape \(24,\) into Muon"):
        choose_muon_params(model, muon=["norm.*"])
    with pytest.raises(MuonParamsError, match=r"'mlp.0.weight' is matched by muon='mlp.0.w\*' and by adam='mlp.\*'"):
        choose_muon_params(model, muon=["mlp.0.w*"], adam=["mlp.*"])
    with pytest.raises(MuonParamsError, match="a list of patterns"):
        choose_muon_params(model, muon="mlp.*")


def test_a_projection_that_does_not_fit_the_heads_is_named():
    model = _Plain()
    model.attn.num_key_value_heads = 2  # k_proj has 8 rows: 1 head of 8, not 2
    with pytest.raises(MuonParamsError, match=r"per_head: attn.k_proj.weight has 8 output features but its attention "
                                              r"module gives 16 \(2 heads x head_dim 8\)"):
        choose_muon_params(model, per_head=True)
    assert choose_muon_params(model)["attn.k_proj.weight"].muon  # per_head off: no geometry needed
    del model.attn.num_heads
    model.attn.num_key_value_heads = 1
    with pytest.raises(MuonParamsError, match=r"attention module 'attn' \(_Attention\) gives no head count"):
        choose_muon_params(model, per_head=True)
