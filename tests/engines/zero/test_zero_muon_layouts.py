"""Muon under ZeRO across layouts: tensor parallelism (data 2 x tensor 2), checkpoints reloaded at another world
size and stage, and the config's errors.

Tensor parallelism uses test_zero_mesh's hand-split MLP (an unevenly row-split, two-section up projection and
a column-split down projection): in "gather" mode each matrix is assembled over the tensor group before its
orthogonalization, so 10 steps equal the single-process reference on the unsplit model in fp64; in "shard"
mode each tensor rank orthogonalizes its own piece, which is a different (documented) optimizer.
"""

from __future__ import annotations

import pytest
import torch
from muon_testlib import muon_config, reference_loop
from polyaccel.testing.multiprocess import run_ranks
from zero_testlib import build_model, global_batch, loss_of

pytestmark = pytest.mark.timeout(300)

STEPS = 10
TP_MUON = ["mlp.down_weight"]  # a bare Parameter, not a Linear: the rule leaves it to Adam unless told


def _choices(model, **params):
    from polyaccel.engines.zero.muon import choose_params
    from polyaccel.engines.zero.muon_config import parse_muon

    return choose_params(model, [n for n, p in model.named_parameters() if p.requires_grad], parse_muon(params))


# ------------------------------------------------------------------ tensor parallelism
def train_tp(rank: int, world: int, cases: list[tuple[int, str]]) -> dict:
    from polyaccel import comm
    from polyaccel.comm.mesh import init_parallel_mesh
    from polyaccel.engines.zero import ZeroEngine
    from test_zero_mesh import Full, batch, split_model

    torch.set_num_threads(1)
    mesh = init_parallel_mesh(tensor=2)
    out = {}
    for stage, mode in cases:
        model = Full().double()
        splits = split_model(model, mesh)
        cfg = muon_config(stage, bucket=60, gather=80, micro=2, muon_params=TP_MUON, tensor_parallel=mode)
        engine = ZeroEngine(model, cfg, mesh=mesh)
        losses = []
        for step in range(STEPS):
            loss = engine(batch(step, mesh.rank("data")))
            engine.backward(loss)
            engine.step()
            t = torch.tensor([loss.item()], dtype=torch.float64)
            comm.all_reduce(t)
            losses.append(t.item() / world)
        tp_matrices = sorted(m.name for g in engine.groups for m in getattr(g.optimizer, "matrices", [])
                             if m.tp is not None)
        out[(stage, mode)] = {"losses": losses, "params": engine.full_state_dict(), "splits": splits,
                              "tensor_rank": mesh.rank("tensor"), "tp_matrices": tp_matrices}
        engine.destroy()
    return out


def _tp_reference():
    from test_zero_mesh import Full, batch

    model = Full().double()
    choices = _choices(model, muon_params=TP_MUON)
    assert choices["mlp.up.weight"].muon and choices["mlp.down_weight"].muon
    return reference_loop(model, lambda m, step: sum(m(batch(step, d)) for d in range(2)) / 2, STEPS, choices)


def test_tensor_parallel_gather_equals_single_process_and_shard_differs():
    cases = [(1, "gather"), (3, "gather"), (2, "shard")]
    results = run_ranks(train_tp, 4, cases, timeout=280)
    ref_losses, ref_params = _tp_reference()
    for case in cases[:2]:
        got = [results[r][case] for r in range(4)]
        assert got[0]["tp_matrices"] == ["mlp.down_weight", "mlp.up.weight"]
        for step in range(STEPS):
            assert abs(got[0]["losses"][step] - ref_losses[step]) <= 1e-10, (case, step)
        by_tensor = {g["tensor_rank"]: g for g in got}
        for name, ref in ref_params.items():
            split = got[0]["splits"].get(name)
            full = got[0]["params"][name] if split is None else split.assemble(
                [by_tensor[t]["params"][name] for t in range(2)])
            err = (full - ref).abs().max().item()
            assert err <= 1e-10, f"{case}: {name} off by {err:.3g}"
    shard = results[0][(2, "shard")]
    assert shard["tp_matrices"] == []
    assert max(abs(a - b) for a, b in zip(shard["losses"], ref_losses, strict=True)) > 1e-6


# ------------------------------------------------------------------ checkpoints
def _train(engine, start: int, n: int, world: int) -> list[float]:
    """Steps on the 2-rank global batch, split evenly over this engine's ``world`` ranks."""
    from polyaccel import comm

    rank, per = comm.get_rank(), 2 // world
    losses = []
    for step in range(start, start + n):
        loss = loss_of(engine, global_batch(step, 2)[rank * 2 * per:(rank + 1) * 2 * per])
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        comm.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def save_at(rank: int, world: int, ckpt: str, stage: int):
    import polyaccel

    torch.set_num_threads(1)
    engine = polyaccel.initialize(build_model("llama", torch.float64), muon_config(stage, micro=2 // world))
    first = _train(engine, 0, 5, world)
    engine.save_checkpoint(ckpt)
    engine.destroy()
    return first


def load_at(rank: int, world: int, ckpt: str, stage: int):
    import polyaccel

    torch.set_num_threads(1)
    engine = polyaccel.initialize(build_model("llama", torch.float64, seed=7), muon_config(stage, micro=2 // world))
    engine.load_checkpoint(ckpt)
    after = _train(engine, 5, 5, world)
    params = engine.full_state_dict()  # a collective in stage 3
    engine.destroy()
    return after, params


@pytest.mark.parametrize("saved, loaded", [((2, 1), (1, 3)), ((1, 3), (2, 2))],
                         ids=["world2-stage1-to-world1-stage3", "world1-stage3-to-world2-stage2"])
def test_checkpoint_continues_at_another_world_size_and_stage(tmp_path, saved, loaded):
    ckpt = str(tmp_path / "ckpt")
    first = run_ranks(save_at, saved[0], ckpt, saved[1], timeout=120)[0]
    after, params = run_ranks(load_at, loaded[0], ckpt, loaded[1], timeout=120)[0]
    model = build_model("llama", torch.float64)
    ref, ref_params = reference_loop(model, lambda m, step: loss_of(m, global_batch(step, 2)), STEPS,
                                     _choices(model))
    for step, (a, b) in enumerate(zip(first + after, ref, strict=True)):
        assert abs(a - b) <= 1e-10 * max(1.0, abs(b)), f"step {step}: {a} vs uninterrupted {b}"
    for name, want in ref_params.items():  # the Muon momentum came through: the weights end where they would
        torch.testing.assert_close(params[name], want, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------ config errors
@pytest.mark.parametrize("params, key", [
    ({"momentum": 1.0}, "optimizer.params.momentum"),
    ({"ns_dtype": "int8"}, "optimizer.params.ns_dtype"),
    ({"lr_adjustment": "sqrt"}, "optimizer.params.lr_adjustment"),
    ({"ns_steps": 100}, "optimizer.params.ns_steps"),
    ({"ns_coefficients": [1, 2]}, "optimizer.params.ns_coefficients"),
    ({"adam_betas": [0.9, 1.0]}, "optimizer.params.adam_betas"),
    ({"gather_bucket_size": 0}, "optimizer.params.gather_bucket_size"),
    ({"tensor_parallel": "split"}, "optimizer.params.tensor_parallel"),
    ({"muon_params": "*.weight"}, None),  # one string: accepted as one pattern
    ({"muon_params": [3]}, "optimizer.params.muon_params"),
    ({"betas": [0.9, 0.99]}, "optimizer.params.betas"),  # Adam's key: muon names its own adam_betas
])
def test_muon_config_errors_name_the_key(params, key):
    import copy

    from polyaccel.engines.zero.config import parse_config
    from polyaccel.errors import ConfigError

    cfg = {"optimizer": {"type": "Muon", "params": params}}
    before = copy.deepcopy(cfg)
    if key is None:
        assert parse_config(cfg).optimizer.muon.muon_params == ("*.weight",)
        return
    with pytest.raises(ConfigError) as err:
        parse_config(cfg)
    msg = str(err.value)
    assert key in msg and "\n" not in msg, msg
    assert cfg == before


def test_muon_config_defaults_and_a_pattern_the_rule_refuses():
    import polyaccel
    from polyaccel.engines.zero.config import parse_config
    from polyaccel.errors import ConfigError

    opt = parse_config({"optimizer": {"type": "muon"}}).optimizer
    assert (opt.lr, opt.muon.momentum, opt.muon.nesterov, opt.muon.ns_dtype) == (0.02, 0.95, True, torch.bfloat16)
    with pytest.raises(ConfigError, match="optimizer.params.*nothing_matches"):
        polyaccel.initialize(build_model("llama", torch.float64),
                             {"optimizer": {"type": "muon", "params": {"muon_params": ["nothing_matches*"]}}})


# ------------------------------------------------------------------ fp16 loss scaling
def fp16_runs(rank: int, world: int, powers: list) -> dict:
    """fp16 Muon on one rank: a dynamic scale that starts far too high (the first steps overflow) and a static
    one, each fed the same batch until a step applies, so both apply the same sequence of batches."""
    import polyaccel

    torch.set_num_threads(1)
    out = {}
    for power in powers:
        fp16 = {"enabled": True, "hysteresis": 1}
        fp16.update({"initial_scale_power": power} if power is not None else {"loss_scale": 1024.0})
        cfg = {**muon_config(1, micro=2, ns_dtype="fp32"), "fp16": fp16}
        engine = polyaccel.initialize(build_model("llama", torch.float32, edge=False), cfg)
        before = (engine.partitioner.master.clone(), engine.optimizer.state["exp_avg"].clone())
        first_skip = None
        for step in range(6):
            while True:
                engine.backward(loss_of(engine, global_batch(step, 1)))
                if engine.step():
                    break
                if first_skip is None:  # a skipped step leaves the master weights and the momentum alone
                    first_skip = (torch.equal(engine.partitioner.master, before[0]),
                                  torch.equal(engine.optimizer.state["exp_avg"], before[1]))
        out[power] = {"skipped": engine.skipped_steps, "first_skip": first_skip,
                      "master": engine.partitioner.master.clone()}
        engine.destroy()
    return out


def test_fp16_overflow_skips_the_muon_step_and_later_steps_are_full_size():
    got = run_ranks(fp16_runs, 1, [24, None], timeout=120)[0]
    dynamic, static = got[24], got[None]
    assert dynamic["skipped"] >= 5 and static["skipped"] == 0
    assert dynamic["first_skip"] == (True, True)
    moved = (static["master"] - build_model_master()).abs().max().item()
    assert moved > 0.03, "six steps of lr 0.02 moved the weights"
    # the same six updates, whatever scale the gradients carried (unscaled before the momentum); what is left
    # is fp16 rounding of the differently scaled gradients (about 1e-3 here)
    assert (dynamic["master"] - static["master"]).abs().max().item() < 5e-3


def build_model_master() -> torch.Tensor:
    """The initial weights in the engine's flat order (reverse registration), fp16-rounded as the engine holds."""
    model = build_model("llama", torch.float32, edge=False)
    return torch.cat([p.detach().half().float().reshape(-1) for p in reversed(list(model.parameters()))])
