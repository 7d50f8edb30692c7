"""The built-in rule sets of ``preset_model``: the split of a model family, written as ``layer_specs``."""

from __future__ import annotations

import re

from polyaccel.errors import ConfigError

from .config import LayerSpec


def preset_specs(name: str) -> tuple[LayerSpec, ...]:
    def spec(pattern, ptype, sub=None):
        return LayerSpec((pattern,), ptype, sub, False, None, f"preset_model {name!r}", (re.compile(pattern),))

    def blocks(attn_in, attn_out, mlp_in, mlp_out, embedding, mlp_in_parts=None):
        """A decoder's rules: the layers into attention and the MLP are column, the ones out of them row,
        the embedding and the lm_head split on the vocabulary."""
        return (spec(attn_in, "column"), spec(attn_out, "row"), spec(mlp_in, "column", mlp_in_parts),
                spec(mlp_out, "row"), spec(embedding, "vocab"), spec(r"(.*\.)?lm_head$", "vocab"))

    llama = blocks(r".*self_attn\.[qkv]_proj$", r".*self_attn\.o_proj$", r".*mlp\.(gate|up)_proj$",
                   r".*mlp\.down_proj$", r"(.*\.)?embed_tokens$")
    if name in ("llama", "mistral", "qwen2"):
        return llama
    if name == "qwen3":
        return (*llama, spec(r".*self_attn\.[qk]_norm$", "replicated_with_grad_allreduce"))
    if name == "phi3":  # fused [q | k | v], split on whole KV heads; [gate | up] split per half
        return blocks(r".*self_attn\.qkv_proj$", r".*self_attn\.o_proj$", r".*mlp\.gate_up_proj$",
                      r".*mlp\.down_proj$", r"(.*\.)?embed_tokens$", mlp_in_parts=2)
    if name == "gpt2":
        return blocks(r".*attn\.c_attn$", r".*attn\.c_proj$", r".*mlp\.c_fc$", r".*mlp\.c_proj$", r"(.*\.)?wte$")
    raise ConfigError(f"unknown preset_model {name!r}")  # parse() already rejects it
