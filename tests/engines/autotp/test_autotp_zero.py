"""AutoTP composed with ZeRO through ``polyaccel.initialize``: 4 gloo ranks = tensor 2 x data 2,
and its checkpoints reloaded at other tensor degrees. (One test: the 4-rank run both trains the
composition cases and writes the checkpoint, which saves starting 4 more processes.)

Composition.
The config's ``tensor_parallel`` section makes ``initialize`` build the mesh, shard the model
and hand ZeRO the data dimension. Qwen3 (GQA, q_norm/k_norm with summed gradients, uneven
vocabulary) at ZeRO stages 1, 2 and 3, at stage 3 a tied-embedding Llama (one vocab-parallel
weight used by two modules), and at stages 2 and 3 Qwen3 with one KV head (tensor rank 1 holds no
heads, so its q_norm/k_norm get no gradient there) train 10 AdamW steps with gradient clipping
(float64); losses, the reported gradient norm (each element counted once)
and the parameters (assembled from the tensor ranks by their recorded splits) equal
single-process training on the concatenated data-parallel batches.

Checkpoints. Phi-3 by the preset (fused [q | k | v] split on whole KV heads and packed
[gate | up]: every section re-cut at every degree; 6 heads over 2 KV heads, so tp 3 and 4 have
ranks without heads; vocabulary 1001) trains 5 steps at tensor 2 x data 2 (ZeRO stage 2), saves,
and goes on for 3 steps ("never stopped"). The checkpoint is loaded at tensor 3 (3 ranks, stage
1), tensor 1 x data 2 (2 ranks, stage 2) and tensor 4 (4 ranks, stage 3): every rank's parameters
are bitwise the consolidated originals cut by its own split, and 3 continued steps equal the run
that never stopped and single-process training (float64). ``polyaccel zero-to-fp32`` turns the
checkpoint into the full state dict a plain Hugging Face Phi-3 loads.
"""

from __future__ import annotations

import pytest
import torch
from autotp_testlib import VOCAB, build, ce, piece, split_of
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


def train(rank: int, world: int, runs, ckpt: str) -> dict:
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
        assert engine.tp_plan is not None and engine.ep_plan is None
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
    out["never_stopped"] = save_run(ckpt)
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


def _check_composition(results):
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


# ---------------------------------------------------------------------------------------------- checkpoints
CASE, SAVED_AT, MORE = "phi3-fused", 5, 3
PRESET = {"preset_model": "phi3"}


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (4, 8), generator=g)


def rows(step: int, data_rank: int, data_size: int) -> torch.Tensor:
    per = 4 // data_size
    return global_batch(step)[data_rank * per:(data_rank + 1) * per]


def ckpt_config(stage: int, tp: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 4000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"optimizer": {"type": "adamw", "params": {"lr": LR, "weight_decay": WD}}, "zero_optimization": zero,
            "train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": tp, **PRESET}}


def _steps(engine, start: int, count: int) -> list[float]:
    from polyaccel import comm

    mesh = engine.mesh
    losses = []
    for step in range(start, start + count):
        ids = rows(step, mesh.rank("data"), mesh.size("data"))
        if mesh.size("tensor") > 1:  # the vocab-parallel loss, in float64
            loss = engine(input_ids=ids, labels=ids).loss
        else:  # (transformers' own loss would compute in float32)
            loss = ce(engine(input_ids=ids).logits, ids)
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        comm.all_reduce(t)
        losses.append(t.item() / comm.get_world_size())
    return losses


def save_run(ckpt: str) -> list[float]:
    import polyaccel

    engine = polyaccel.initialize(build(CASE), ckpt_config(2, 2))
    _steps(engine, 0, SAVED_AT)
    engine.save_checkpoint(ckpt, tag="saved")
    losses = _steps(engine, SAVED_AT, MORE)
    engine.destroy()
    return losses


def load_run(rank: int, world: int, ckpt: str, tp: int, stage: int) -> dict:
    import polyaccel

    torch.set_num_threads(1)
    engine = polyaccel.initialize(build(CASE, seed=1), ckpt_config(stage, tp))  # other initial weights: all must load
    engine.load_checkpoint(ckpt, tag="saved")
    params = engine.full_state_dict()
    splits = {n: split_of(p) for n, p in engine.module.named_parameters()}
    losses = _steps(engine, SAVED_AT, MORE)
    engine.destroy()
    return {"params": params, "splits": splits, "losses": losses}


def ckpt_reference():
    model = build(CASE)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, saved = [], None
    for step in range(SAVED_AT + MORE):
        if step == SAVED_AT:
            saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ids = global_batch(step)
        loss = ce(model(input_ids=ids).logits, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, saved


def _check_checkpoint(ckpt: str, never_stopped: list[float], tmp_path, capsys):
    from polyaccel.cli import main
    from polyaccel.engines.zero.consolidate import consolidate

    ref_losses, ref_saved = ckpt_reference()
    full = consolidate(ckpt, tag="saved")
    for name, ref in ref_saved.items():
        assert (full[name] - ref).abs().max().item() <= 1e-10, name

    for tp, world, stage in ((3, 3, 1), (1, 2, 2), (4, 4, 3)):
        results = run_ranks(load_run, world, ckpt, tp, stage, timeout=200)
        for rank, got in enumerate(results):
            for name, local in got["params"].items():
                if name not in got["splits"]:
                    continue  # buffers
                want = piece(full[name], got["splits"][name])
                assert torch.equal(local, want), f"tp {tp} rank {rank}: {name} is not the saved tensor's piece"
            if tp > 1:
                assert any(s is not None for s in got["splits"].values())
        for step, (a, b, r) in enumerate(zip(results[0]["losses"], never_stopped, ref_losses[SAVED_AT:],
                                             strict=True)):
            assert abs(a - b) <= 1e-10 and abs(a - r) <= 1e-10, (tp, step, a, b, r)

    # zero-to-fp32: the full state dict, loaded by a plain Hugging Face model
    out = tmp_path / "full.safetensors"
    assert main(["zero-to-fp32", ckpt, str(out), "--tag", "saved"]) == 0, capsys.readouterr().err
    from safetensors.torch import load_file

    state = load_file(str(out))
    plain = build(CASE, seed=2)
    plain.load_state_dict(state, strict=True)
    ids = global_batch(SAVED_AT)
    reloaded = build(CASE, seed=2)
    reloaded.load_state_dict(ref_saved)
    assert (plain(input_ids=ids).logits - reloaded(input_ids=ids).logits).abs().max().item() <= 1e-10


def test_tp2_dp2_zero_stages_and_checkpoints(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    results = run_ranks(train, TP * DATA, RUNS, ckpt, timeout=280)
    _check_composition(results)
    _check_checkpoint(ckpt, results[0]["never_stopped"], tmp_path, capsys)
