"""Small dense models of the families AutoTP is tested on, built offline from config objects.

``tiny_config(family)`` gives the test size (hidden 48, 6 heads over 2 KV heads, intermediate
100, vocabulary 1001: uneven over 2, 3 and 4 ranks); ``full_config(family)`` is transformers'
default config for the model type, i.e. the released model's shapes (``polyaccel autotp-plan``
builds those on the meta device). Dropout is off in the tiny configs.
"""

from __future__ import annotations

import os

FAMILIES = ("llama", "llama-tied", "mistral", "qwen3", "phi3", "gpt2")


def _classes(family: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as tf

    table = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "llama-tied": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
    }
    if family not in table:
        from polyaccel.errors import ConfigError

        raise ConfigError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    return table[family]


def tiny_config(family: str, *, vocab: int = 1001, hidden: int = 48, heads: int = 6, kv_heads: int = 2,
                intermediate: int = 100, layers: int = 2, **overrides):
    cfg_cls, _ = _classes(family)
    if family == "gpt2":
        kw = dict(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=intermediate,
                  n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    else:
        kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                  attention_dropout=0.0, tie_word_embeddings=family == "llama-tied", bos_token_id=0,
                  eos_token_id=0, pad_token_id=None)
        if family == "qwen3":
            kw["head_dim"] = hidden // heads
        if family == "phi3":
            kw.update(resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0)
    kw.update(overrides)
    return cfg_cls(**kw)


def full_config(family: str):
    cfg_cls, _ = _classes(family)
    return cfg_cls(tie_word_embeddings=True) if family == "llama-tied" else cfg_cls()


def build(cfg, family: str):
    """A freshly initialised model of ``family`` (current torch RNG and default device)."""
    _, model_cls = _classes(family)
    model = model_cls(cfg)
    model.config.use_cache = False
    return model


__all__ = ["FAMILIES", "build", "full_config", "tiny_config"]
