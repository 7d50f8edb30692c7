"""Shared pieces of the ZeRO tests: tiny HF models built offline, data, and the single-process reference."""

from __future__ import annotations

import torch

VOCAB = 61
SEQ = 12
MICRO = 2


class EdgeWrapper(torch.nn.Module):
    """An HF causal LM plus the awkward parameters: zero-size, smaller than the world, and frozen."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.empty = torch.nn.Parameter(torch.zeros(0, 3))
        self.tiny = torch.nn.Parameter(torch.randn(1))
        self.frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)

    def forward(self, input_ids):
        return lm_loss(self.lm, input_ids) + self.empty.sum() + 0.01 * (self.tiny * self.frozen.sum()).square().sum()


def lm_loss(lm, ids):
    """Next-token cross entropy in the model's dtype (HF's own loss upcasts to fp32, too coarse for fp64 checks)."""
    logits = lm(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def build_model(kind: str, dtype: torch.dtype, seed: int = 0, edge: bool = True) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind.startswith("llama"):
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                          tie_word_embeddings=False)
        lm = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        lm = GPT2LMHeadModel(cfg)
    lm.config.use_cache = False
    if kind.endswith("-actckpt"):  # HF activation checkpointing (non-reentrant, its default)
        enable = getattr(lm, "activation_checkpointing_enable", None) or lm.gradient_checkpointing_enable
        enable()
        lm.train()
    model = EdgeWrapper(lm) if edge else lm
    return model.to(dtype)


def batch(step: int, rank: int, micro: int = 0, size: int = MICRO) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g)


def global_batch(step: int, world: int, gas: int = 1) -> torch.Tensor:
    return torch.cat([batch(step, r, m) for m in range(gas) for r in range(world)])


def loss_of(model, ids):
    module = getattr(model, "module", model)
    return model(ids) if isinstance(module, EdgeWrapper) else lm_loss(model, ids)


def reference_run(kind, dtype, steps, world, opt="adamw", lr=1e-2, wd=0.01, clip=0.0, gas=1):
    """Plain single-process training on the concatenated global batches; returns losses and params."""
    from polyaccel.optim import FusedLamb, FusedLion

    model = build_model(kind, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    if opt == "adamw":
        optim = torch.optim.AdamW(params, lr=lr, weight_decay=wd)
    elif opt == "lion":
        optim = FusedLion(params, lr=lr, weight_decay=wd, betas=(0.9, 0.999))  # DeepSpeed's default betas
    else:
        optim = FusedLamb(params, lr=lr, weight_decay=wd, eps=1e-8)  # the engine uses DeepSpeed's default eps
    losses, norms = [], []
    for step in range(steps):
        loss = loss_of(model, global_batch(step, world, gas))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))))
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def zero_config(stage, opt="adamw", lr=1e-2, wd=0.01, offload=False, offload_param=False, clip=0.0, gas=1,
                bucket=2000, persistence=0, granularity=0, ratio=1.0, **extra):
    zero = {"stage": stage, "reduce_bucket_size": bucket}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = persistence
        zero["stage3_prefetch_bucket_size"] = 2000
        if granularity:
            zero["stage3_module_granularity_threshold"] = granularity
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", **({"ratio": ratio} if ratio != 1 else {})}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    cfg = {"optimizer": {"type": opt, "params": {"lr": lr, "weight_decay": wd}}, "zero_optimization": zero,
           "gradient_accumulation_steps": gas, "train_micro_batch_size_per_gpu": MICRO}
    if clip:
        cfg["gradient_clipping"] = clip
    cfg.update(extra)
    return cfg


def train_engine(engine, steps, rank, start=0, gas=1):
    """Run ``steps`` optimizer steps; returns the global mean loss per step (all-reduced)."""
    from polyaccel import comm

    losses = []
    for step in range(start, start + steps):
        total = 0.0
        for m in range(gas):
            loss = loss_of(engine, batch(step, rank, m))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        t = torch.tensor([total / gas], dtype=torch.float64)
        comm.all_reduce(t)
        losses.append(t.item() / comm.get_world_size())
    return losses
