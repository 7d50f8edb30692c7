"""Tiny Hugging Face models of the families the kernels layer swaps into, built offline, and the float64
reference they are compared against."""

from __future__ import annotations

import copy
import functools
import os

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "phi3")
ALL_ON = {"rms_norm": True, "rope": True, "swiglu": True, "cross_entropy": True}
VOCAB = 97
SEQ = 9
BATCH = 2


def config(family: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=None, use_cache=False)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return tf.Qwen2Config(**common)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=8)
    if family == "qwen3_moe":  # layer 0 dense (Qwen3MoeMLP), layer 1 sparse
        return tf.Qwen3MoeConfig(**common, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                 decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                                 experts_implementation="eager")
    if family == "gemma2":
        return tf.Gemma2Config(**{**common, "pad_token_id": 0}, head_dim=8, sliding_window=64,
                               attn_implementation="eager")
    if family == "phi3":  # partial rotary: the first half of each head's features rotated
        return tf.Phi3Config(**{**common, "pad_token_id": 0}, resid_pdrop=0.0, embd_pdrop=0.0,
                             partial_rotary_factor=0.5)
    raise ValueError(family)


def build(family: str, dtype=torch.float64, seed: int = 0, **overrides):
    import transformers as tf

    transformers_logging()
    cfg = config(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
           "qwen3": tf.Qwen3ForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM, "gemma2": tf.Gemma2ForCausalLM,
           "phi3": tf.Phi3ForCausalLM}[family]
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # norms away from their init (ones / zeros), so the (1 + w) form matters
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype)


def transformers_logging():
    import transformers

    transformers.logging.set_verbosity_error()


def ids(step: int = 0, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def ce(logits, ids):
    """Next-token cross entropy in the logits' dtype (HF's own loss upcasts to fp32 only)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                                             ids[:, 1:].reshape(-1))


def _exact_norm(module, offset, x):
    w = module.weight
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w)


def exact_norms(model):
    """The reference without the float32 round trip Hugging Face's RMSNorms make even on float64 inputs (they
    normalise in float32 whatever the dtype): the same formula in the input's dtype, written here."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            offset = 1.0 if type(module).__name__.startswith("Gemma") else 0.0
            module.forward = functools.partial(_exact_norm, module, offset)
    return model


def pair(family: str, dtype=torch.float64, section=None, **overrides):
    """(Hugging Face's model, a copy with the kernels swapped in), equal parameters."""
    from polyaccel.engines.kernels import apply_kernels

    ref = build(family, dtype, **overrides)
    fast = copy.deepcopy(ref)
    apply_kernels(fast, ALL_ON if section is None else section)
    return ref, fast


class OpCalls:
    """Counts the calls each polyaccel op gets (wrapping ``polyaccel.ops.<name>``), to prove the kernels ran."""

    NAMES = ("rms_norm", "rope", "swiglu", "linear_cross_entropy")

    def __init__(self, monkeypatch):
        from polyaccel import ops

        self.counts = dict.fromkeys(self.NAMES, 0)
        for name in self.NAMES:
            fn = getattr(ops, name)

            def counted(*a, _fn=fn, _name=name, **k):
                self.counts[_name] += 1
                return _fn(*a, **k)

            monkeypatch.setattr(ops, name, counted)
