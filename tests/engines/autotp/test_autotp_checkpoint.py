"""AutoTP checkpoints: save at tensor 2 x data 2, reload at other degrees directly, consolidate.

Phi-3 by the preset (fused [q | k | v] split on whole KV heads and packed [gate | up]: every
section re-cut at every degree; 6 heads over 2 KV heads, so tp 3 and 4 have ranks without heads;
vocabulary 1001) trains 5 steps at tensor 2 x data 2 (ZeRO stage 2), saves, and goes on for 3
steps ("never stopped"). The checkpoint is loaded at tensor 3 (3 ranks, stage 1), tensor 1 x data
2 (2 ranks, stage 2) and tensor 4 (4 ranks, stage 3): every rank's parameters are bitwise the
consolidated originals cut by its own split, and 3 continued steps equal the run that never
stopped and single-process training (float64). ``polyaccel zero-to-fp32`` turns the checkpoint
into the full state dict a plain Hugging Face Phi-3 loads.
"""

from __future__ import annotations

import pytest
import torch
from autotp_testlib import VOCAB, build, ce, piece, split_of
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(300)

CASE, SAVED_AT, MORE, LR, WD = "phi3-fused", 5, 3, 1e-2, 0.01
PRESET = {"preset_model": "phi3"}


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (4, 8), generator=g)


def rows(step: int, data_rank: int, data_size: int) -> torch.Tensor:
    per = 4 // data_size
    return global_batch(step)[data_rank * per:(data_rank + 1) * per]


def config(stage: int, tp: int) -> dict:
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


def save_run(rank: int, world: int, ckpt: str) -> dict:
    import polyaccel

    torch.set_num_threads(1)
    engine = polyaccel.initialize(build(CASE), config(2, 2))
    _steps(engine, 0, SAVED_AT)
    engine.save_checkpoint(ckpt, tag="saved")
    losses = _steps(engine, SAVED_AT, MORE)
    engine.destroy()
    return {"losses": losses}


def load_run(rank: int, world: int, ckpt: str, tp: int, stage: int) -> dict:
    import polyaccel

    torch.set_num_threads(1)
    engine = polyaccel.initialize(build(CASE, seed=1), config(stage, tp))  # other initial weights: all must load
    engine.load_checkpoint(ckpt, tag="saved")
    params = engine.full_state_dict()
    splits = {n: split_of(p) for n, p in engine.module.named_parameters()}
    losses = _steps(engine, SAVED_AT, MORE)
    engine.destroy()
    return {"params": params, "splits": splits, "losses": losses}


def reference():
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


def test_save_at_tp2_dp2_reload_at_other_degrees(tmp_path, capsys):
    from polyaccel.cli import main
    from polyaccel.engines.zero.consolidate import consolidate

    ckpt = str(tmp_path / "ckpt")
    never_stopped = run_ranks(save_run, 4, ckpt, timeout=200)[0]["losses"]
    ref_losses, ref_saved = reference()
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
