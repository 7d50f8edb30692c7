"""Shared pieces of the AutoEP tests: tiny MoE models, per-rank inputs, and the HF references."""

from __future__ import annotations

import copy

import torch

H = 32
VOCAB = 61
SEQ = 8
MICRO = 2
BLOCK = 1  # the decoder layer whose MoE block the block-level tests compare (layer 0 is dense in some families)


class LegacyExpert(torch.nn.Module):
    """A transformers-4 style expert MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = torch.nn.Linear(hidden, ffn, bias=False)
        self.w2 = torch.nn.Linear(ffn, hidden, bias=False)
        self.w3 = torch.nn.Linear(hidden, ffn, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class LegacyMoeBlock(torch.nn.Module):
    """transformers-4 Mixtral's block: a Linear router, a ModuleList of experts, returns (hidden, router_logits)."""

    def __init__(self, hidden: int = H, ffn: int = 24, experts: int = 8, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.num_experts = experts
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(LegacyExpert(hidden, ffn) for _ in range(experts))

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        router_logits = self.gate(x)
        w = torch.softmax(router_logits, dim=1, dtype=torch.float)
        w, sel = torch.topk(w, self.top_k, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, pos = torch.where(sel == e)
            if tok.numel():
                out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, pos, None])
        return out.view(b, s, h), router_logits


class LegacyModel(torch.nn.Module):
    """Two legacy MoE layers under ``layers.N.block_sparse_moe`` (a model without an HF config)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"block_sparse_moe": LegacyMoeBlock()})
                                          for _ in range(2))


def build(family: str, seed: int = 0, **kw) -> torch.nn.Module:
    """A tiny model in float64 (the legacy one for ``"legacy"``)."""
    from polyaccel.engines.autoep.models import build_tiny

    if family == "legacy":
        torch.manual_seed(seed)
        return LegacyModel().double()
    return build_tiny(family, torch.float64, seed=seed, **kw)


def block_of(model, family: str) -> torch.nn.Module:
    if family == "legacy":
        return model.layers[BLOCK]["block_sparse_moe"]
    return model.model.layers[BLOCK].mlp


def skew(model, family: str) -> None:
    """Router weights that send every token with positive features to expert 0, then 1 (no ties)."""
    block = block_of(model, family)
    gate = block.gate
    with torch.no_grad():
        E = gate.weight.shape[0]
        coef = torch.tensor([10.0, 5.0] + [-1.0 - 0.5 * i for i in range(E - 2)], dtype=gate.weight.dtype)
        gate.weight.copy_(coef[:, None].expand_as(gate.weight))
        bias = getattr(gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.zero_()


def tokens(rank: int, n: int, seed: int = 0, positive: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * seed + rank)
    x = torch.randn(1, n, H, generator=g, dtype=torch.float64)
    return x.abs() if positive else x


def probe(rank: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * seed + 50 + rank)
    return torch.randn(1, n, H, generator=g, dtype=torch.float64)


def hidden_of(out):
    return out[0] if isinstance(out, tuple) else out


def reference_block(family: str, sizes: list[int], seed: int = 0, skewed: bool = False, model_kw=None) -> dict:
    """The untouched HF block on all ranks' tokens; loss = mean over ranks of sum(out_r * probe_r)."""
    model = build(family, **(model_kw or {}))
    if skewed:
        skew(model, family)
    block = copy.deepcopy(block_of(model, family))
    x = torch.cat([tokens(r, n, seed, positive=skewed) for r, n in enumerate(sizes)], dim=1).requires_grad_(True)
    p = torch.cat([probe(r, n, seed) for r, n in enumerate(sizes)], dim=1)
    logits = []
    block.gate.register_forward_hook(lambda m, a, o: logits.append(o[0] if isinstance(o, tuple) else o))
    out = hidden_of(block(x))
    loss = (out * p).sum() / len(sizes)
    loss.backward()
    grads = {n: q.grad.clone() for n, q in block.named_parameters()}
    return {"out": out.detach()[0], "logits": logits[0].detach(), "x_grad": x.grad[0], "grads": grads}


def lm_loss(lm, ids):
    """Next-token cross entropy in the model's dtype (HF's own loss upcasts to fp32, too coarse for fp64 checks)."""
    logits = lm(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def batch(step: int, rank: int, size: int = MICRO) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g)


def reference_training(family: str, steps: int, world: int, lr: float = 1e-2, wd: float = 0.01, start: int = 0,
                       model=None, optim=None):
    """Single-process AdamW on the concatenated global batches; returns (losses, state_dict, model, optim)."""
    if model is None:
        model = build(family)
        optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    losses = []
    for step in range(start, start + steps):
        ids = torch.cat([batch(step, r) for r in range(world)])
        loss = lm_loss(model, ids)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, model, optim


def shared_result(tmp_path_factory, key: str, produce):
    """``produce()`` once per test session, even when pytest-xdist workers share a module's tests.

    The first worker to get here runs it and leaves the pickled result in the session's shared
    temporary folder; the others wait on the lock and read it.
    """
    import os
    import pickle

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return produce()
    from filelock import FileLock

    path = tmp_path_factory.getbasetemp().parent / f"{key}.pkl"
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return pickle.loads(path.read_bytes())
        value = produce()
        path.write_bytes(pickle.dumps(value))
        return value
