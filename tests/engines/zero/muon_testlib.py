"""Muon under ZeRO, the pieces its tests share: the config and the single-process reference loop.

The reference steps the model's matrices with the reference ``fused_muon`` and everything else with the
reference ``fused_adam``, on the concatenated global batch: what ``MuonWithAuxAdam`` computes, written
out op by op so the check does not rest on the engine's own code.
"""

from __future__ import annotations

import torch

HP = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.9, "nesterov": True, "ns_dtype": "fp64",
      "lr_adjustment": "original", "adam_lr": 3e-3, "adam_betas": [0.9, 0.95], "adam_eps": 1e-10,
      "adam_weight_decay": 0.02}


def muon_config(stage: int, *, offload=False, gas=1, bucket=2000, gather=1500, micro=2, **params) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": bucket}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=2000)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"optimizer": {"type": "muon", "params": {**HP, "gather_bucket_size": gather, **params}},
            "zero_optimization": zero, "gradient_accumulation_steps": gas, "train_micro_batch_size_per_gpu": micro}


def reference_loop(model, loss_of_step, steps: int, choices: dict, hp=None) -> tuple[list[float], dict]:
    """``steps`` Muon + auxiliary-Adam steps of ``model`` in one process; ``loss_of_step(model, step)`` is the
    step's loss on the whole global batch. Returns the losses and the final parameters."""
    from polyaccel.ops.reference.muon import fused_muon
    from polyaccel.ops.reference.optimizers import fused_adam

    hp = {**HP, **(hp or {})}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [(n, p) for n, p in named if choices[n].muon]
    adam = [(n, p) for n, p in named if not choices[n].muon]
    bufs = [torch.zeros_like(p) for _, p in muon]
    m1 = [torch.zeros_like(p) for _, p in adam]
    m2 = [torch.zeros_like(p) for _, p in adam]
    ns = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}[hp["ns_dtype"]]
    losses = []
    for step in range(steps):
        loss = loss_of_step(model, step)
        loss.backward()
        with torch.no_grad():
            fused_muon([p for _, p in muon], [p.grad for _, p in muon], bufs, lr=hp["lr"], momentum=hp["momentum"],
                       weight_decay=hp["weight_decay"], nesterov=hp["nesterov"], ns_dtype=ns,
                       lr_adjustment=hp["lr_adjustment"], head_splits=[choices[n].head_split for n, _ in muon])
            fused_adam([p for _, p in adam], [p.grad for _, p in adam], m1, m2, lr=hp["adam_lr"],
                       beta1=hp["adam_betas"][0], beta2=hp["adam_betas"][1], eps=hp["adam_eps"],
                       weight_decay=hp["adam_weight_decay"], step=step + 1)
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
