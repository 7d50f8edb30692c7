"""The kernels layer composed through ``polyaccel.initialize``: ZeRO stages 1-3 (and stage 3 with Hugging Face's
activation checkpointing, and with the optimizer and parameters offloaded) in one process; AutoEP before it; then
one 2-rank gloo launch with ZeRO stage 3 over data 2, and with AutoTP 2 (the lm_head split over the vocabulary: the
vocab-parallel fused cross-entropy; the MLPs' forward on AutoTP's split projections). Every run trains a tiny model
in float64 and its losses equal training without kernels (the reference's norms in float64, see
``kernels_testlib.exact_norms``) to 1e-10."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import ALL_ON, OpCalls, build, ce, exact_norms, ids
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(300)

STEPS, LR, WD = 3, 1e-2, 0.01


def config(stage: int, offload: bool = False, **layers) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 5000}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["offload_param"] = {"device": "cpu"}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"optimizer": {"type": "adamw", "params": {"lr": LR, "weight_decay": WD}}, "zero_optimization": zero,
            "train_micro_batch_size_per_gpu": 2, **layers}


def reference_losses(batches, family="llama") -> list[float]:
    """Plain single-process AdamW on Hugging Face's model (float64 norms), loss on the whole batch."""
    model = exact_norms(build(family))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for x in batches:
        loss = ce(model(input_ids=x).logits, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_kernels(cfg, batches, checkpointing=False, family="llama") -> tuple[list[float], object]:
    import polyaccel

    model = build(family)
    if checkpointing:  # Hugging Face's (non-reentrant): the decoder layers' forwards rerun in backward
        model.activation_checkpointing_enable()
    engine = polyaccel.initialize(model, cfg)
    losses = []
    try:
        engine.train()
        for x in batches:
            out = engine(input_ids=x, labels=x)
            assert out.logits is None  # the fused loss ran: no logits were formed
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
        from polyaccel.parallel import get_plan

        plan = get_plan(engine.module, "kernels")
    finally:
        engine.destroy()
    return losses, plan


@pytest.fixture
def world_of_one():
    from polyaccel import comm

    was = comm.is_initialized()
    yield
    if not was and comm.is_initialized():
        comm.destroy()


@pytest.mark.parametrize("stage,checkpointing,offload", [(1, False, False), (2, False, False), (3, False, False),
                                                          (3, True, False), (3, False, True)],
                         ids=["stage1", "stage2", "stage3", "stage3-actckpt", "stage3-offload"])
def test_zero_trains_the_same_with_kernels(stage, checkpointing, offload, world_of_one, monkeypatch):
    batches = [ids(s) for s in range(STEPS)]
    cfg = config(stage, offload, kernels=dict(ALL_ON))
    calls = OpCalls(monkeypatch)
    losses, plan = train_kernels(cfg, batches, checkpointing)
    # 2 attentions a step; with checkpointing their recomputation in backward runs the kernel again
    assert calls.counts["rope"] == 2 * STEPS * (2 if checkpointing else 1)
    assert calls.counts["linear_cross_entropy"] == STEPS
    assert cfg["kernels"] == ALL_ON and "tensor_parallel" not in cfg  # the caller's config is not modified
    assert plan.count("rms_norm") == 5 and plan.count("rope") == 2 and plan.count("swiglu") == 2
    assert plan.swapped[""] == "cross_entropy"
    want = reference_losses(batches)
    assert losses == pytest.approx(want, rel=1e-10, abs=1e-12)


def test_after_autoep_the_dense_parts_run_the_kernels(world_of_one):
    """Qwen3-MoE through AutoEP (autoep_size 1: the experts run AutoEP's grouped path) and the kernels: the dense
    layer's MLP, the norms, the rotary and the loss are swapped, the MoE block is AutoEP's; the losses equal
    Hugging Face's model trained without either."""
    batches = [ids(s) for s in range(STEPS)]
    cfg = config(2, expert_parallel={"autoep_size": 1}, kernels=dict(ALL_ON))
    losses, plan = train_kernels(cfg, batches, family="qwen3_moe")
    assert plan.count("swiglu") == 1 and plan.count("rope") == 2 and plan.swapped[""] == "cross_entropy"
    assert "model.layers.1.mlp" not in plan.swapped
    assert losses == pytest.approx(reference_losses(batches, "qwen3_moe"), rel=1e-10, abs=1e-12)


def _ranks(rank: int, world: int) -> dict:
    import polyaccel
    from polyaccel import comm

    torch.set_num_threads(1)
    out = {}
    # ZeRO stage 3 over data 2: each rank its half of the global batch
    batches = [ids(s, batch=4) for s in range(STEPS)]
    losses, plan = train_kernels(config(3, kernels=dict(ALL_ON)), [b[2 * rank:2 * rank + 2] for b in batches])
    mean = []
    for v in losses:
        t = torch.tensor([v], dtype=torch.float64)
        comm.all_reduce(t)
        mean.append(t.item() / world)
    out["stage3"] = (mean, reference_losses(batches))
    # AutoTP 2 (data 1): the lm_head split over the vocabulary, the loss vocab-parallel
    losses, plan = train_kernels(config(1, tensor_parallel={"autotp_size": 2}, kernels=dict(ALL_ON)), batches)
    out["tp"] = (losses, reference_losses(batches), plan.swapped.get(""), plan.count("swiglu"))
    assert polyaccel is not None
    return out


def test_two_ranks_stage3_and_autotp_vocab_parallel_loss():
    results = run_ranks(_ranks, 2, timeout=240)
    for out in results:
        got, want = out["stage3"]
        assert got == pytest.approx(want, rel=1e-10, abs=1e-12)
        got, want, swapped, mlps = out["tp"]
        assert swapped == "cross_entropy (vocab-parallel over tensor)"
        assert mlps == 2  # the MLPs' split gate/up/down projections called by the swapped forward
        assert got == pytest.approx(want, rel=1e-10, abs=1e-12)
