"""AutoEP composed with ZeRO through ``polyaccel.initialize`` (gloo, float64).

Training: 4 ranks = ep 2 x expert_data 2; tiny Mixtral at ZeRO stages 1, 2 and 3 and tiny
Qwen2-MoE (shared expert + sigmoid gate) at stage 3 train 10 AdamW steps with gradient
clipping. Losses and the reported gradient norm equal single-process training of the HF
model on the concatenated data-parallel batches; expert parameters are identical within each
expert_data pair, dense ones on every rank, and the assembled parameters equal the reference.

Checkpoints: saved at ep 2 (4 ranks, stage 2) after 3 steps, then loaded at ep 4 (stage 1) and
ep 1 (stage 3) on 4 ranks and at ep 2 on 2 ranks (stage 2, two micro-batches per rank: the
same global batch): exact weights, and 3 continued steps equal the run that never stopped.
``zero-to-fp32``'s consolidation gives the HF state dict with fused 3-D expert tensors.
"""

from __future__ import annotations

import pytest
import torch
from autoep_testlib import batch, build, lm_loss, shared_result
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(300)

STEPS, LR, WD, CLIP, EP, WORLD = 10, 1e-2, 0.01, 1.0, 2, 4
RUNS = [("mixtral", 1), ("mixtral", 2), ("mixtral", 3), ("qwen2_moe", 3)]
SAVE_AT, MORE = 3, 3
LOADS = [(4, 1), (1, 3)]  # (ep, stage) on 4 ranks


def config(stage: int, ep: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 5000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"optimizer": {"type": "adamw", "params": {"lr": LR, "weight_decay": WD}}, "zero_optimization": zero,
            "gradient_clipping": CLIP, "expert_parallel": {"autoep_size": ep}}


def data_batch(step: int, data_rank: int, data_size: int) -> torch.Tensor:
    """This data rank's share of the global batch (4 micro-batches of 2 sequences, split over the ranks)."""
    per = WORLD // data_size
    return torch.cat([batch(step, data_rank * per + i) for i in range(per)])


def _steps(engine, start: int, n: int) -> tuple[list[float], list[float]]:
    from polyaccel import comm

    mesh = engine.mesh
    losses, norms = [], []
    for step in range(start, start + n):
        loss = lm_loss(engine, data_batch(step, mesh.rank("data"), mesh.size("data")))
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        comm.all_reduce(t)
        losses.append(t.item() / comm.get_world_size())
        norms.append(engine.last_grad_norm)
    return losses, norms


def _snapshot(engine) -> dict:
    from polyaccel.engines.autoep import ep_plan
    from polyaccel.parallel import get_layout

    mesh = engine.mesh
    return {"params": engine.full_state_dict(),
            "splits": {n: get_layout(p).split for n, p in engine.module.named_parameters()},
            "ep_rank": mesh.rank("expert"), "data_rank": mesh.rank("data"), "plan": str(ep_plan(engine))}


def train_runs(rank: int, world: int, runs) -> dict:
    import polyaccel

    torch.set_num_threads(1)
    out = {}
    for family, stage in runs:
        cfg = config(stage, EP)
        engine = polyaccel.initialize(build(family), cfg)
        assert "expert_parallel" in cfg, "the caller's config is not modified"
        assert engine.ep_plan is not None and engine.tp_plan is None
        losses, norms = _steps(engine, 0, STEPS)
        out[(family, stage)] = {"losses": losses, "norms": norms, **_snapshot(engine)}
        engine.destroy()
    return out


def save_and_reload(rank: int, world: int, path: str) -> dict:
    import polyaccel

    torch.set_num_threads(1)
    engine = polyaccel.initialize(build("mixtral"), config(2, EP))
    _steps(engine, 0, SAVE_AT)
    engine.save_checkpoint(path, tag="saved")
    saved = _snapshot(engine)
    out = {"saved": saved, "continued": _steps(engine, SAVE_AT, MORE)[0]}
    engine.destroy()
    for ep, stage in LOADS:
        engine = polyaccel.initialize(build("mixtral", seed=7), config(stage, ep))  # other weights: load must win
        engine.load_checkpoint(path, tag="saved")
        loaded = _snapshot(engine)
        out[(ep, stage)] = {**loaded, "continued": _steps(engine, SAVE_AT, MORE)[0]}
        engine.destroy()
    return out


def reload_on_two(rank: int, world: int, path: str) -> dict:
    import polyaccel

    torch.set_num_threads(1)
    engine = polyaccel.initialize(build("mixtral", seed=7), config(2, EP))
    engine.load_checkpoint(path, tag="saved")
    loaded = _snapshot(engine)
    out = {**loaded, "continued": _steps(engine, SAVE_AT, MORE)[0]}
    engine.destroy()
    return out


def reference(family: str, steps: int):
    model = build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms, states = [], [], []
    for step in range(steps):
        ids = torch.cat([batch(step, r) for r in range(WORLD)])
        loss = lm_loss(model, ids)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return losses, norms, states


def _full(got: list[dict], name: str, ep: int, data_rank_of=None) -> torch.Tensor:
    """The full tensor of ``name`` from the ranks of data-parallel replica 0 (assembled by its split)."""
    split = got[0]["splits"][name]
    if split is None:
        return got[0]["params"][name]
    by_ep = {}
    for g in got:
        by_ep.setdefault(g["ep_rank"], g["params"][name])
    return split.assemble([by_ep[r] for r in range(ep)])


def _check_params(got: list[dict], ref: dict, ep: int, what: str, tol: float = 1e-10):
    for name, want in ref.items():
        split = got[0]["splits"][name]
        for g in got:
            piece = g["params"][name]
            expect = want if split is None else split.piece(want, g["ep_rank"])
            err = (piece - expect).abs().max().item()
            assert err <= tol, f"{what}: {name} on ep rank {g['ep_rank']}, data rank {g['data_rank']} off by {err:.3g}"
        if split is not None:
            assert split.degree == ep and split.dim == "expert" and split.axis == 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.set_num_threads(1)
    return shared_result(tmp_path_factory, "autoep_zero_train", lambda: run_ranks(train_runs, WORLD, RUNS, timeout=280))


@pytest.mark.parametrize("family, stage", RUNS)
def test_ep2_expert_data2_zero_matches_single_process(trained, family, stage):
    ref_losses, ref_norms, ref_states = reference(family, STEPS)
    got = [trained[r][(family, stage)] for r in range(WORLD)]
    assert [g["ep_rank"] for g in got] == [0, 1, 0, 1] and [g["data_rank"] for g in got] == [0, 1, 2, 3]
    assert "ep=2, expert_data=2" in got[0]["plan"]
    for step in range(STEPS):
        assert abs(got[0]["losses"][step] - ref_losses[step]) <= 1e-10, (family, stage, step)
        for g in got:
            assert abs(g["norms"][step] - ref_norms[step]) <= 1e-9 * ref_norms[step], (family, stage, step)
    _check_params(got, ref_states[-1], EP, f"{family} stage {stage}")
    for name, split in got[0]["splits"].items():
        pairs = [(0, 2), (1, 3)] if split is not None else [(0, r) for r in range(1, WORLD)]
        for a, b in pairs:
            assert torch.equal(got[a]["params"][name], got[b]["params"][name]), (
                f"{family} stage {stage}: {name} differs between ranks {a} and {b}")


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    torch.set_num_threads(1)

    def produce():
        path = str(tmp_path_factory.mktemp("autoep_ckpt"))
        four = run_ranks(save_and_reload, WORLD, path, timeout=280)
        two = run_ranks(reload_on_two, 2, path, timeout=200)
        from polyaccel.engines.zero.consolidate import consolidate

        return four, two, consolidate(path, tag="saved", progress=False)

    return shared_result(tmp_path_factory, "autoep_zero_ckpt", produce)


def test_checkpoint_reloads_at_other_expert_degrees(checkpoint_runs):
    four, two, _ = checkpoint_runs
    ref_losses, _, ref_states = reference("mixtral", SAVE_AT + MORE)
    saved = [four[r]["saved"] for r in range(WORLD)]
    _check_params(saved, ref_states[SAVE_AT - 1], EP, "saved at ep 2")
    never_stopped = four[0]["continued"]
    for a, b in zip(never_stopped, ref_losses[SAVE_AT:], strict=True):
        assert abs(a - b) <= 1e-10
    loads = {f"ep {ep} stage {stage} on 4 ranks": ([four[r][(ep, stage)] for r in range(WORLD)], ep)
             for ep, stage in LOADS}
    loads["ep 2 stage 2 on 2 ranks"] = (two, EP)
    for what, (got, ep) in loads.items():
        assert f"ep={ep}" in got[0]["plan"]
        assert sorted({g["ep_rank"] for g in got}) == list(range(ep))
        # exact weights: the loaded pieces are the saved model's, cut for this layout
        _check_params(got, ref_states[SAVE_AT - 1], ep, f"{what}: loaded")
        for g in got:
            for name, piece in g["params"].items():
                split = g["splits"][name]
                full_saved = _full(saved, name, EP)
                expect = full_saved if split is None else split.piece(full_saved, g["ep_rank"])
                assert torch.equal(piece, expect), f"{what}: {name} not loaded exactly"
        for step, (a, b) in enumerate(zip(got[0]["continued"], never_stopped, strict=True)):
            assert abs(a - b) <= 1e-10, f"{what}: continued step {step}: {a} vs never stopped {b}"


def test_zero_to_fp32_gives_the_hf_state_dict(checkpoint_runs):
    four, _, state = checkpoint_runs
    _, _, ref_states = reference("mixtral", SAVE_AT)
    hf = build("mixtral").state_dict()
    assert set(state) == set(hf), sorted(set(state) ^ set(hf))
    for name, t in state.items():
        assert t.shape == hf[name].shape, name
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 48, 32)
    for name, want in ref_states[-1].items():
        assert (state[name] - want).abs().max().item() <= 1e-10, name


def test_every_token_to_every_expert_under_stage3_matches_single_process(monkeypatch):
    """ep 1, top-k = every expert: the dense path (its products gathered by stage 3's hooks around the
    experts module) trains like the HF model, 4 clipped AdamW steps in one process."""
    import polyaccel
    from polyaccel.engines.autoep import moe

    torch.set_num_threads(1)
    dense = []
    real = moe.run_dense_experts
    monkeypatch.setattr(moe, "run_dense_experts", lambda *a: dense.append(1) or real(*a))
    ref = build("mixtral", experts=4, top_k=4)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    engine = polyaccel.initialize(build("mixtral", experts=4, top_k=4), config(3, 1))
    try:
        for step in range(4):
            ids = torch.cat([batch(step, r) for r in range(2)])
            loss = lm_loss(engine, ids)
            engine.backward(loss)
            engine.step()
            want = lm_loss(ref, ids)
            want.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            assert abs(loss.item() - want.item()) <= 1e-10, (step, loss.item(), want.item())
        assert dense
        got = engine.full_state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        engine.destroy()
