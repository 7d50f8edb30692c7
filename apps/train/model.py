"""The model ``polyaccel train`` trains: a small HF Llama (or GPT-2) built from a config.

Built offline from a config object (no hub access, no weights to download). Dropout is off so
that a resumed run can reproduce an uninterrupted one exactly without saving RNG streams.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

from polyaccel.config_check import Int, OneOf, check_flag
from polyaccel.errors import ConfigError

MODELS = ("llama", "gpt2", "mixtral")
#: the sizes ``validate`` checks, and the flags that set them
_SIZE_FLAGS = {"hidden_size": "--hidden-size", "num_layers": "--layers", "num_heads": "--heads"}


@dataclass(frozen=True)
class ModelSpec:
    """What defines the network's shape; a checkpoint only resumes into the same spec."""

    name: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    max_positions: int = 256

    def validate(self) -> ModelSpec:
        name = check_flag("--model", self.name, OneOf(MODELS))
        sizes = {key: check_flag(flag, getattr(self, key), Int(1)) for key, flag in _SIZE_FLAGS.items()}
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --heads {self.num_heads}; "
                "pick a hidden size that is a multiple of the head count"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} / --heads {self.num_heads} gives an odd head size "
                f"({self.hidden_size // self.num_heads}); rotary embeddings need an even one"
            )
        return replace(self, name=name, **sizes)

    def as_dict(self) -> dict:
        return asdict(self)


def hf_config(spec: ModelSpec):
    """The transformers config object for ``spec`` (imports transformers lazily)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec.name == "mixtral":  # a small MoE: 8 experts of width 2 x hidden, top-2 (AutoEP runs them)
        from transformers import MixtralConfig

        return MixtralConfig(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=2 * spec.hidden_size,
            num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_heads // 2 if spec.num_heads % 2 == 0 else spec.num_heads,
            max_position_embeddings=spec.max_positions, attention_dropout=0.0, num_local_experts=8,
            num_experts_per_tok=2, router_jitter_noise=0.0, experts_implementation="eager",
            bos_token_id=0, eos_token_id=0, pad_token_id=None, tie_word_embeddings=False,
        )
    if spec.name == "llama":
        from transformers import LlamaConfig

        kv_heads = spec.num_heads // 2 if spec.num_heads % 2 == 0 else spec.num_heads
        return LlamaConfig(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=2 * spec.hidden_size,
            num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=kv_heads,
            max_position_embeddings=spec.max_positions, attention_dropout=0.0,
            bos_token_id=0, eos_token_id=0, pad_token_id=None, tie_word_embeddings=False,
        )
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=spec.vocab_size, n_embd=spec.hidden_size, n_layer=spec.num_layers, n_head=spec.num_heads,
        n_positions=spec.max_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )


def build_model(spec: ModelSpec):
    """A freshly initialised causal LM (uses the current torch RNG: seed first)."""
    spec.validate()
    if spec.name == "mixtral":
        from transformers import MixtralForCausalLM

        model = MixtralForCausalLM(hf_config(spec))
        model.train()
        return model
    if spec.name == "llama":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(hf_config(spec))
    else:
        from transformers import GPT2LMHeadModel

        model = GPT2LMHeadModel(hf_config(spec))
    model.train()
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
