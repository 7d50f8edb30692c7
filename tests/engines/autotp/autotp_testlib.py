"""Shared pieces of the AutoTP tests: tiny HF models (float64), batches, and the single-process reference."""

from __future__ import annotations

import torch

VOCAB = 1001
SEQ = 10
BATCH = 2
STEPS = 10
LR = 1e-2
WD = 0.01

# case -> (model family, tensor_parallel keys besides autotp_size)
CASES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "gpt2": ("gpt2", {}),
    "phi3-fused": ("phi3", {"preset_model": "phi3"}),
    "phi3-hf-plan": ("phi3", {}),
    "phi3-explicit": ("phi3", {"partition_config": {"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.qkv_proj$"], "partition_type": "column", "shape": [[48, 16, 16], -1]},
        {"patterns": [r".*\.gate_up_proj$"], "partition_type": "column", "shape": [2, -1]},
        {"patterns": [r".*\.(o_proj|down_proj)$"], "partition_type": "row"},
        {"patterns": [r".*embed_tokens$", r".*lm_head$"], "partition_type": "vocab"},
    ]}}),
    "llama-tied": ("llama-tied", {}),
    "qwen3-actckpt": ("qwen3", {}),  # HF activation checkpointing: the forward's collectives rerun in backward
}


# model variants beyond the families' tiny configs: name -> (family, tiny_config overrides)
VARIANTS = {"qwen3-kv1": ("qwen3", {"kv_heads": 1})}  # one KV head: at tp 2, rank 1 holds no heads


def build(case: str, seed: int = 0, dtype=torch.float64):
    import transformers
    from polyaccel.engines.autotp.models import build as build_family
    from polyaccel.engines.autotp.models import tiny_config

    transformers.logging.set_verbosity_error()
    family, overrides = VARIANTS.get(case, (CASES[case][0] if case in CASES else case, {}))
    torch.manual_seed(seed)
    return build_family(tiny_config(family, **overrides), family).to(dtype)


def section(case: str, tp: int) -> dict:
    return {"autotp_size": tp, **CASES[case][1]}


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def ce(logits, ids):
    """Next-token cross entropy in the logits' dtype (HF's own loss upcasts to fp32 only)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def reference(case: str) -> dict:
    """Single-process float64: logits, loss and grads on batch 0, then 10 AdamW steps on batches 1..10."""
    model = build(case)
    ids = batch(0)
    logits = model(input_ids=ids).logits
    loss = ce(logits, ids)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(1, STEPS + 1):
        ids = batch(step)
        loss_s = ce(model(input_ids=ids).logits, ids)
        loss_s.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss_s.item())
    return {"logits": logits.detach(), "loss": loss.item(), "grads": grads, "losses": losses,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def split_of(param):
    from polyaccel.parallel import get_layout

    s = get_layout(param).split
    return None if s is None else (s.dim, s.axis, s.sections, s.rank)


def piece(full: torch.Tensor, split) -> torch.Tensor:
    from polyaccel.parallel import Split

    return full if split is None else Split(*split).piece(full)


class Allocations:
    """Shapes of the tensors ops allocate inside the ``with`` block (views and in-place results excluded)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        shapes: list[tuple[int, ...]] = []
        self.shapes = shapes

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                        if isinstance(t, torch.Tensor) and t.numel()}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in seen:
                        shapes.append(tuple(t.shape))
                return out

        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    @property
    def elements(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes)


def loss_allocations(mesh) -> dict:
    """Elements the vocab-parallel cross-entropy allocates (forward and backward) on this rank for N tokens over
    the 1001-word vocabulary, and what F.cross_entropy allocates on the full logits."""
    from polyaccel.engines.autotp import vocab_parallel_cross_entropy
    from polyaccel.engines.autotp.shard import shard_sizes

    n = BATCH * SEQ
    tp, rank = mesh.size("tensor"), mesh.rank("tensor")
    sizes = shard_sizes(VOCAB, tp)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(n, VOCAB, generator=g, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (n,), generator=g)
    local = full[:, sum(sizes[:rank]):sum(sizes[: rank + 1])].clone().requires_grad_()
    with Allocations() as ours:
        loss = vocab_parallel_cross_entropy(local, target, group=mesh.group("tensor"), vocab_start=sum(sizes[:rank]))
        loss.backward()
    ref_logits = full.clone().requires_grad_()
    with Allocations() as ref:
        ref_loss = torch.nn.functional.cross_entropy(ref_logits, target)
        ref_loss.backward()
    grad_err = (local.grad - ref_logits.grad[:, sum(sizes[:rank]):sum(sizes[: rank + 1])]).abs().max().item()
    return {"ours": ours.elements, "ref": ref.elements, "local": n * sizes[rank], "full": n * VOCAB,
            "loss_err": abs(loss.item() - ref_loss.item()), "grad_err": grad_err}
