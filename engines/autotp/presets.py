"""The built-in rule sets of ``preset_model``: the split of a model family, written as ``layer_specs``."""

from __future__ import annotations

import re

from polyaccel.errors import ConfigError

from .config import LayerSpec


def preset_specs(name: str) -> tuple[LayerSpec, ...]:
    def spec(pattern, ptype, sub=None):
        return LayerSpec((pattern,), ptype, sub, False, None, f"preset_model {name!r}", (re.compile(pattern),))

    llama = [
        spec(r".*self_attn\.[qkv]_proj$", "column"),
        spec(r".*self_attn\.o_proj$", "row"),
        spec(r".*mlp\.(gate|up)_proj$", "column"),
        spec(r".*mlp\.down_proj$", "row"),
        spec(r"(.*\.)?embed_tokens$", "vocab"),
        spec(r"(.*\.)?lm_head$", "vocab"),
    ]
    if name in ("llama", "mistral", "qwen2"):
        return tuple(llama)
    if name == "qwen3":
        return (*llama, spec(r".*self_attn\.[qk]_norm$", "replicated_with_grad_allreduce"))
    if name == "phi3":
        return (
            spec(r".*self_attn\.qkv_proj$", "column"),  # fused [q | k | v], split on whole KV heads
            spec(r".*self_attn\.o_proj$", "row"),
            spec(r".*mlp\.gate_up_proj$", "column", 2),
            spec(r".*mlp\.down_proj$", "row"),
            spec(r"(.*\.)?embed_tokens$", "vocab"),
            spec(r"(.*\.)?lm_head$", "vocab"),
        )
    if name == "gpt2":
        return (
            spec(r".*attn\.c_attn$", "column"),
            spec(r".*attn\.c_proj$", "row"),
            spec(r".*mlp\.c_fc$", "column"),
            spec(r".*mlp\.c_proj$", "row"),
            spec(r"(.*\.)?wte$", "vocab"),
            spec(r"(.*\.)?lm_head$", "vocab"),
        )
    raise ConfigError(f"unknown preset_model {name!r}")  # parse() already rejects it
