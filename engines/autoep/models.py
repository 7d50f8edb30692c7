"""Small MoE models of the supported families, built offline from config objects.

``tiny_config(family)`` gives a few-thousand-parameter config (tests, ``polyaccel train
--model mixtral``); ``full_config(family)`` gives transformers' default config for the model
type, i.e. the released model's shapes (``polyaccel autoep-plan`` builds those on the meta
device). Every config uses the eager ("loop over experts") HF expert implementation, the
reference AutoEP is compared against.
"""

from __future__ import annotations

import os

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe")


def _classes(family: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as tf

    table = {
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
    }
    if family not in table:
        from polyaccel.errors import ConfigError

        raise ConfigError(f"unknown MoE family {family!r}; choose one of {', '.join(FAMILIES)}")
    return table[family]


def tiny_config(family: str, *, vocab: int = 61, hidden: int = 32, layers: int = 2, experts: int = 8,
                top_k: int = 2, ffn: int = 24, **overrides):
    """A tiny config: ``experts`` experts of width ``ffn``, top-``top_k``; layer 0 dense where the family allows."""
    cfg_cls, _ = _classes(family)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, num_experts_per_tok=top_k,
                  experts_implementation="eager", tie_word_embeddings=False, attention_dropout=0.0,
                  bos_token_id=0, eos_token_id=0, pad_token_id=None)
    if family == "mixtral":
        kw = dict(num_local_experts=experts, intermediate_size=ffn, router_jitter_noise=0.0)
    elif family == "qwen2_moe":
        kw = dict(num_experts=experts, moe_intermediate_size=ffn, intermediate_size=2 * ffn,
                  shared_expert_intermediate_size=40, decoder_sparse_step=1, mlp_only_layers=[0],
                  norm_topk_prob=False)
    elif family in ("qwen3_moe", "olmoe"):
        kw = dict(num_experts=experts, moe_intermediate_size=ffn, intermediate_size=2 * ffn, norm_topk_prob=True)
        if family == "qwen3_moe":
            kw.update(decoder_sparse_step=1, mlp_only_layers=[0], head_dim=16)
    else:  # deepseek_v3, glm4_moe
        kw = dict(n_routed_experts=experts, moe_intermediate_size=ffn, intermediate_size=2 * ffn, n_shared_experts=1,
                  n_group=4 if experts % 4 == 0 else 1, topk_group=2 if experts % 4 == 0 else 1,
                  first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True)
        if family == "deepseek_v3":
            kw.update(num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                      qk_nope_head_dim=8, v_head_dim=8)
        else:
            kw.update(head_dim=16)
    return cfg_cls(**{**common, **kw, **overrides})


def full_config(family: str):
    """transformers' default config for the family (the released model's shapes)."""
    cfg_cls, _ = _classes(family)
    return cfg_cls(experts_implementation="eager")


def build(config, family: str | None = None):
    """A causal LM for ``config`` (uses the current torch RNG and default device)."""
    if family is None:
        family = config.model_type
    _, model_cls = _classes(family)
    model = model_cls(config)
    model.config.use_cache = False
    return model


def build_tiny(family: str, dtype=None, seed: int = 0, randomize_bias: bool = True, **kw):
    """A tiny model with seeded weights; DeepSeek-style correction biases get random values (not zeros)."""
    import torch

    torch.manual_seed(seed)
    model = build(tiny_config(family, **kw), family)
    if randomize_bias:
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.1)
    return model.to(dtype) if dtype is not None else model
