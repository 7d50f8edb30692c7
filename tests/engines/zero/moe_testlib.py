"""MoE models whose experts run only where tokens are routed, with routing forced to differ by rank.

Routing is decided by the token ids (a fixed table: token ``t`` may only go to two experts), so a
rank whose batch holds only some token classes runs only some experts, and single-process training
on the concatenated batches routes every token exactly as the rank that holds it does. The router's
weights are still trained: they set the mixing weights of the two allowed experts.

Layouts, each a way real code keeps per-expert modules:

- ``qwen3-wrapper``: Hugging Face's Qwen3-MoE (tiny config, built offline) whose fused 3-D experts are
  replaced by :class:`ExpertLoop`, a wrapper at ``mlp.experts`` holding a ``ModuleList`` (named
  ``mlps``) and running, like HF's eager loop, only the experts that got tokens, in index order;
- ``getattr``: a hand-written block whose experts are attributes ``expert_0`` .. ``expert_3`` called
  through ``getattr(self, f"expert_{e}")``;
- ``bank``: a hand-written block holding a wrapper (``self.ffn``, class :class:`ExpertBank`) whose
  ``ModuleDict`` of experts is indexed by ``str(e)``.
"""

from __future__ import annotations

import torch

VOCAB, HIDDEN, FFN, EXPERTS, TOP_K, SEQ, MICRO = 32, 8, 6, 4, 2, 6, 2
STEPS = 10


def allowed_experts(ids: torch.Tensor) -> torch.Tensor:
    """[tokens, EXPERTS] bool: token ``t`` may go to experts ``t % E`` and ``(t + 1) % E``."""
    t = ids.reshape(-1)
    out = torch.zeros(t.numel(), EXPERTS, dtype=torch.bool)
    out[torch.arange(t.numel()), t % EXPERTS] = True
    out[torch.arange(t.numel()), (t + 1) % EXPERTS] = True
    return out


class ForcedRouter(torch.nn.Module):
    """Qwen3-MoE's top-k router (same weight, same outputs) restricted to the experts the token ids allow."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN) * 0.5)
        self.ids = None  # set by the model's forward: the token ids of the batch, in the flattened order

    def forward(self, h):
        h = h.reshape(-1, HIDDEN)
        logits = torch.nn.functional.linear(h, self.weight)
        masked = logits.masked_fill(~allowed_experts(self.ids), float("-inf"))
        probs = torch.softmax(masked, dim=-1)
        top, index = torch.topk(probs, TOP_K, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return logits, top, index


class Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = torch.nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.down = torch.nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


def run_hit_experts(h, index, weights, expert_of):
    """HF's eager experts loop: only the experts some token was routed to, in index order."""
    out = torch.zeros_like(h)
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(index, num_classes=EXPERTS).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        slot, token = torch.where(mask[e[0]])
        y = expert_of(int(e[0]))(h[token]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


class ExpertLoop(torch.nn.Module):
    """The issue's wrapper: called as ``experts(h, index, weights)`` on every rank, runs the hit experts."""

    def __init__(self):
        super().__init__()
        self.mlps = torch.nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, h, index, weights):
        return run_hit_experts(h, index, weights, lambda e: self.mlps[e])


class GetattrBlock(torch.nn.Module):
    """Experts as numbered attributes, reached with ``getattr``."""

    def __init__(self):
        super().__init__()
        self.gate = ForcedRouter()
        for e in range(EXPERTS):
            setattr(self, f"expert_{e}", Expert())

    def forward(self, h):
        _, weights, index = self.gate(h)
        return run_hit_experts(h.reshape(-1, HIDDEN), index, weights,
                               lambda e: getattr(self, f"expert_{e}")).reshape(h.shape)


class ExpertBank(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.ModuleDict({str(e): Expert() for e in range(EXPERTS)})

    def forward(self, h, index, weights):
        return run_hit_experts(h, index, weights, lambda e: self.table[str(e)])


class BankBlock(torch.nn.Module):
    """A block holding a wrapper (named ``ffn``) whose ModuleDict of experts is indexed by name."""

    def __init__(self):
        super().__init__()
        self.gate = ForcedRouter()
        self.ffn = ExpertBank()

    def forward(self, h):
        _, weights, index = self.gate(h)
        return self.ffn(h.reshape(-1, HIDDEN), index, weights).reshape(h.shape)


class TinyMoeLM(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.block = block()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = h + self.block(h)
        return self.head(self.norm(h))


def _set_router_ids(model, args, kwargs):
    ids = kwargs.get("input_ids", args[0] if args else None)
    for m in model.modules():
        if isinstance(m, ForcedRouter):
            m.ids = ids


def build(kind: str, dtype: torch.dtype, actckpt: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen3-wrapper":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=12, moe_intermediate_size=FFN,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                             num_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=16,
                             tie_word_embeddings=False, use_cache=False)
        model = Qwen3MoeForCausalLM(cfg)
        for layer in model.model.layers:
            layer.mlp.gate = ForcedRouter()
            layer.mlp.experts = ExpertLoop()
        if actckpt:
            model.gradient_checkpointing_enable()
        model.train()
    else:
        model = TinyMoeLM({"getattr": GetattrBlock, "bank": BankBlock}[kind])
    model.register_forward_pre_hook(_set_router_ids, with_kwargs=True)
    return model.to(dtype)


def logits_of(model, ids):
    module = getattr(model, "module", model)
    out = model(input_ids=ids)
    return out.logits if not isinstance(module, TinyMoeLM) else out


def loss_of(model, ids):
    """Next-token cross entropy in the model's dtype."""
    logits = logits_of(model, ids)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank r's tokens are the class ``t % E == 2r % E``: even ranks route to experts 0 and 1 only, odd ranks to
    2 and 3, so every expert runs somewhere and none everywhere; now and then any token, anywhere."""
    g = torch.Generator().manual_seed(100 * step + rank)
    if step % 4 == 3:
        return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    allowed = torch.tensor([t for t in range(VOCAB) if t % EXPERTS == 2 * rank % EXPERTS])
    return allowed[torch.randint(0, len(allowed), (MICRO, SEQ), generator=g)]


def reference(kind: str, dtype: torch.dtype, world: int):
    """Single process on every rank's batch at once (the mean of the per-rank losses, as the engine averages
    gradients over ranks); a parameter without a gradient gets a zero one, as the engine documents."""
    model = build(kind, dtype)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        loss = sum(loss_of(model, batch(step, r)) for r in range(world)) / world
        loss.backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def config(offload: bool = False, actckpt: bool = False, **zero) -> dict:
    z = {"stage": 3, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 16,
         "stage3_prefetch_bucket_size": 400, **zero}
    if offload:
        z["offload_optimizer"] = {"device": "cpu"}
    cfg = {"optimizer": {"type": "adamw", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "zero_optimization": z}
    if actckpt:
        cfg["activation_checkpointing"] = {}
    return cfg
