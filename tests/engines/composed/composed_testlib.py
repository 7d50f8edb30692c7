"""The model, data and single-process reference of the ZeRO x AutoTP x AutoEP tests (float64).

The model is a tiny Mixtral-like MoE from transformers' Qwen3-MoE: GQA attention (4 heads over 2 KV
heads of 8, split on whole KV heads by AutoTP, with per-head q_norm/k_norm whose gradients are
summed over the tensor ranks), layer 0 a dense SwiGLU MLP (split by AutoTP), layer 1 a MoE block of
4 experts, top-2 with renormalised softmax weights (placed by AutoEP), a vocabulary of 64 split by
AutoTP (embedding and lm_head), no tied weights.
"""

from __future__ import annotations

import torch

VOCAB, SEQ, GLOBAL = 64, 8, 4  # GLOBAL sequences per step, split over the data-parallel ranks
STEPS, LR, WD, CLIP = 10, 1e-2, 0.01, 1.0
SAVE_AT, MORE = 5, 3  # the checkpoint holds the state after SAVE_AT steps; MORE steps continue from it


def build(seed: int = 0):
    import transformers
    from polyaccel.engines.autoep.models import build_tiny

    transformers.logging.set_verbosity_error()
    return build_tiny("qwen3_moe", torch.float64, seed=seed, vocab=VOCAB, hidden=32, experts=4, ffn=16,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)


def rows(step: int, data_rank: int, data_size: int) -> torch.Tensor:
    return global_batch(step).chunk(data_size)[data_rank]


def ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in the logits' dtype (transformers' own loss computes in float32)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def config(stage: int, tp: int | None, ep: int | None, accum: int = 1) -> dict:
    """The engine config; ``tp``/``ep`` None leaves that layer's section out."""
    zero = {"stage": stage, "reduce_bucket_size": 2000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    cfg = {"optimizer": {"type": "adamw", "params": {"lr": LR, "weight_decay": WD}}, "zero_optimization": zero,
           "gradient_clipping": CLIP, "gradient_accumulation_steps": accum}
    if tp is not None:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if ep is not None:
        cfg["expert_parallel"] = {"autoep_size": ep}
    return cfg


def loss_of(engine, ids: torch.Tensor) -> torch.Tensor:
    """Split over tensor ranks: the model's loss (the vocab-parallel cross entropy keeps float64); else ``ce``."""
    mesh = engine.mesh
    if mesh is not None and mesh.size("tensor") > 1:
        return engine(input_ids=ids, labels=ids).loss
    return ce(engine(input_ids=ids).logits, ids)


def reference(steps: int = STEPS, skip: tuple[int, ...] = ()):
    """Single-process AdamW with clipping on the global batches: losses, norms, parameters after every step.
    Steps in ``skip`` compute their loss but apply nothing (an fp16 overflow skips the step; its norm is inf)."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms, states = [], [], []
    for step in range(steps):
        ids = global_batch(step)
        loss = ce(model(input_ids=ids).logits, ids)
        loss.backward()
        if step in skip:
            norms.append(float("inf"))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, norms, states


def shared_result(tmp_path_factory, key: str, produce):
    """``produce()`` once per test session, even when pytest-xdist workers share a module's tests."""
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
