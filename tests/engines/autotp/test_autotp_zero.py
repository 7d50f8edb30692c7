"""AutoTP composed with ZeRO through ``polyaccel.initialize``: 4 gloo ranks = tensor 2 x data 2.

The config's ``tensor_parallel`` section makes ``initialize`` build the mesh, shard the model
and hand ZeRO the data dimension. Qwen3 (GQA, q_norm/k_norm with summed gradients, uneven
vocabulary) at ZeRO stages 1, 2 and 3, at stage 3 a tied-embedding Llama (one vocab-parallel
weight used by two modules), and at stages 2 and 3 Qwen3 with one KV head (tensor rank 1 holds no
heads, so its q_norm/k_norm get no gradient there) train 10 AdamW steps with gradient clipping
(float64); losses, the reported gradient norm (each element counted once)
and the parameters (assembled from the tensor ranks by their recorded splits) equal
single-process training on the concatenated data-parallel batches.
"""

from __future__ import annotations

import pytest
import torch
from autotp_testlib import VOCAB, build, ce
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(300)

STEPS, LR, WD, CLIP, TP, DATA = 10, 1e-2, 0.01, 1.0, 2, 2
RUNS = [("qwen3", 1), ("qwen3", 2), ("qwen3", 3), ("llama-tied", 3), ("qwen3-kv1", 2), ("qwen3-kv1", 3)]


def data_batch(step: int, data_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + data_rank)
    return torch.randint(0, VOCAB, (2, 8), generator=g)


def config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 5000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"optimizer": {"type": "adamw", "params": {"lr": LR, "weight_decay": WD}}, "zero_optimization": zero,
            "gradient_clipping": CLIP, "train_micro_batch_size_per_gpu": 2,
            "tensor_parallel": {"autotp_size": TP}}


def train(rank: int, world: int, runs) -> dict:
    import polyaccel
    from polyaccel import comm
    from polyaccel.engines.autotp import get_plan
    from polyaccel.parallel import get_layout

    torch.set_num_threads(1)
    out = {}
    # an autotp_size that does not divide the world: refused by initialize before any weight changes
    model = build("qwen3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        polyaccel.initialize(model, {**config(1), "tensor_parallel": {"autotp_size": 3}})
        out["refusal"] = None
    except polyaccel.ConfigError as exc:
        out["refusal"] = str(exc)
    after = model.state_dict()
    out["unchanged"] = set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    for case, stage in runs:
        cfg = config(stage)
        engine = polyaccel.initialize(build(case), cfg)
        assert "tensor_parallel" in cfg, "the caller's config is not modified"
        mesh = engine.mesh
        splits = {n: get_layout(p).split for n, p in engine.module.named_parameters()}
        losses, norms = [], []
        for step in range(STEPS):
            ids = data_batch(step, mesh.rank("data"))
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            t = torch.tensor([loss.item()], dtype=torch.float64)
            comm.all_reduce(t)
            losses.append(t.item() / world)
            norms.append(engine.last_grad_norm)
        out[(case, stage)] = {
            "losses": losses, "norms": norms, "params": engine.full_state_dict(), "splits": splits,
            "tensor_rank": mesh.rank("tensor"), "data_rank": mesh.rank("data"),
            "counts": get_plan(engine).counts(),
        }
        engine.destroy()
    return out


def reference(case: str):
    model = build(case)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for step in range(STEPS):
        loss = sum(ce(model(input_ids=data_batch(step, d)).logits, data_batch(step, d)) for d in range(DATA)) / DATA
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


def test_tp2_dp2_zero_stages_match_single_process_training():
    results = run_ranks(train, TP * DATA, RUNS, timeout=280)
    for r in range(TP * DATA):
        assert results[r]["refusal"] is not None and results[r]["unchanged"]
        assert "tensor_parallel.autotp_size 3 does not divide the world size 4" in results[r]["refusal"]
        assert "must be one of [1, 2, 4]" in results[r]["refusal"]
    refs = {case: reference(case) for case in {c for c, _ in RUNS}}
    for case, stage in RUNS:
        ref_losses, ref_norms, ref_params = refs[case]
        got = [results[r][(case, stage)] for r in range(TP * DATA)]
        assert {(g["tensor_rank"], g["data_rank"]) for g in got} == {(t, d) for t in range(TP) for d in range(DATA)}
        assert got[0]["counts"]["column"] > 0 and got[0]["counts"]["vocab"] == 2
        for step in range(STEPS):
            assert abs(got[0]["losses"][step] - ref_losses[step]) <= 1e-10, (case, stage, step)
            for r in range(TP * DATA):
                assert abs(got[r]["norms"][step] - ref_norms[step]) <= 1e-9 * ref_norms[step], (case, stage, step, r)
        for name, ref in ref_params.items():
            split = got[0]["splits"][name]
            for d in range(DATA):
                by_tensor = {g["tensor_rank"]: g["params"][name] for g in got if g["data_rank"] == d}
                full = by_tensor[0] if split is None else split.assemble([by_tensor[t] for t in range(TP)])
                if split is None:
                    assert torch.equal(by_tensor[0], by_tensor[1]), f"{case} stage {stage}: {name} differs over tp"
                err = (full - ref).abs().max().item()
                assert err <= 1e-10, f"{case} stage {stage}: {name} (data rank {d}) off by {err:.3g}"
