"""Muon under ZeRO stages 1-3 and optimizer offload on 2 gloo ranks against the single-process reference (fp64).

The tiny Llama has tall, wide and square matrices that straddle the two ranks' partitions (the flat
buckets are 2000 elements), attention projections orthogonalized per head, and a gather buffer small
enough to need several rounds. Each rank counts the matrices it orthogonalizes: every matrix exactly
once per optimizer step over all ranks, also with four accumulated micro-steps per step.
"""

from __future__ import annotations

import pytest
import torch
from muon_testlib import muon_config, reference_loop
from polyaccel.testing.multiprocess import run_ranks
from zero_testlib import build_model, global_batch, loss_of, train_engine

pytestmark = pytest.mark.timeout(300)

STEPS = 10
WORLD = 2
#: name: (config kwargs, accumulation steps)
CASES = {
    "s1": ({"stage": 1}, 1),
    "s2": ({"stage": 2}, 1),
    "s3": ({"stage": 3}, 1),
    "s1-offload": ({"stage": 1, "offload": True}, 1),
    "s2-offload": ({"stage": 2, "offload": True}, 1),
    "s3-offload": ({"stage": 3, "offload": True}, 1),
    "s1-gas4": ({"stage": 1, "gas": 4}, 4),
}


def _count_orthogonalizations(monkeypatch_target):
    """Record the shape of every matrix the engine hands to Newton-Schulz: the round buffer's batches
    (``orthogonalize_batches``) and the matrices orthogonalized alone (``orthogonalize_many``)."""
    calls = []
    real = monkeypatch_target.orthogonalize_many, monkeypatch_target.orthogonalize_batches

    def counting(us, head_splits, mcfg):
        calls.extend(tuple(u.shape) for u in us)
        return real[0](us, head_splits, mcfg)

    def counting_batches(chunk, batches, mcfg):
        calls.extend(m.shape for b in batches for m in b.matrices)
        return real[1](chunk, batches, mcfg)

    monkeypatch_target.orthogonalize_many = counting
    monkeypatch_target.orthogonalize_batches = counting_batches
    return calls, real


def train_cases(rank: int, world: int, names: list[str]) -> dict:
    import polyaccel
    from polyaccel.engines.zero import muon

    torch.set_num_threads(1)
    out = {}
    for name in names:
        kw, gas = CASES[name]
        engine = polyaccel.initialize(build_model("llama", torch.float64), muon_config(**kw, per_head=True))
        calls, real = _count_orthogonalizations(muon)
        try:
            losses = train_engine(engine, STEPS, rank, gas=gas)
        finally:
            muon.orthogonalize_many, muon.orthogonalize_batches = real
        opt = engine.optimizer
        params = engine.full_state_dict()  # a collective in stage 3
        out[name] = {
            "losses": losses, "calls": len(calls), "rounds": len(opt.rounds),
            "matrices": {m.name: (m.owner, m.head_split) for m in opt.matrices},
            "master_device": engine.partitioner.master.device.type,
            "params": params if rank == 0 else None,
        }
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(train_cases, WORLD, list(CASES), timeout=280)


@pytest.fixture(scope="module")
def choices():
    from polyaccel.engines.zero.muon import choose_params
    from polyaccel.engines.zero.muon_config import parse_muon

    model = build_model("llama", torch.float64)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return choose_params(model, names, parse_muon({"per_head": True}))


def _reference(gas: int, choices):
    torch.set_num_threads(1)
    model = build_model("llama", torch.float64)
    return reference_loop(model, lambda m, step: loss_of(m, global_batch(step, WORLD, gas)), STEPS, choices)


@pytest.mark.parametrize("name", list(CASES))
def test_muon_under_zero_equals_single_process_muon(results, choices, name):
    kw, gas = CASES[name]
    ref_losses, ref_params = _reference(gas, choices)
    got = results[0][name]
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
        assert abs(a - b) <= 1e-10 * max(1.0, abs(b)), f"{name}: loss at step {step}: {a} vs reference {b}"
    for key, ref in ref_params.items():
        torch.testing.assert_close(got["params"][key], ref, rtol=1e-10, atol=1e-10,
                                   msg=lambda m, key=key: f"{name}: parameter {key}: {m}")
    assert got["master_device"] == "cpu"
    # the rule's matrices, with the attention projections per head (2 query heads, 1 key/value head)
    owners = got["matrices"]
    assert owners == results[1][name]["matrices"], "both ranks plan alike"
    assert owners["lm.model.layers.0.self_attn.q_proj.weight"][1] == (0, 2)
    assert owners["lm.model.layers.0.self_attn.k_proj.weight"][1] == (0, 1)
    assert owners["lm.model.layers.0.self_attn.o_proj.weight"][1] == (1, 2)
    assert "lm.model.embed_tokens.weight" not in owners and "lm.lm_head.weight" not in owners
    assert {o for o, _ in owners.values()} == {0, 1}, "both ranks own matrices"
    assert got["rounds"] > 1, "the gather buffer bound splits the step into rounds"


@pytest.mark.parametrize("name", list(CASES))
def test_each_matrix_orthogonalized_once_per_optimizer_step(results, name):
    got = [results[r][name] for r in range(WORLD)]
    n = len(got[0]["matrices"])
    assert n == 14  # 7 matrices in each of the 2 decoder layers
    assert sum(g["calls"] for g in got) == n * STEPS, name


def test_the_reference_takes_muon_with_aux_adam_steps(choices):
    """The op-by-op reference above is single-process ``polyaccel.optim.MuonWithAuxAdam`` with the same settings
    (10 steps, fp64, within 1e-10): so each ZeRO case equals ``MuonWithAuxAdam`` too."""
    from muon_testlib import HP
    from polyaccel.optim import MuonWithAuxAdam

    ref_losses, ref_params = _reference(1, choices)
    model = build_model("llama", torch.float64)
    opt = MuonWithAuxAdam(model, per_head=True, lr=HP["lr"], momentum=HP["momentum"], weight_decay=HP["weight_decay"],
                          nesterov=HP["nesterov"], adjust_lr_fn=HP["lr_adjustment"], ns_dtype=torch.float64,
                          adam_lr=HP["adam_lr"], adam_betas=HP["adam_betas"], adam_eps=HP["adam_eps"],
                          adam_weight_decay=HP["adam_weight_decay"])
    muon_names = {n for n, c in choices.items() if c.muon}
    grouped = {id(p): g["use_muon"] for g in opt.param_groups for p in g["params"]}
    assert {n for n, p in model.named_parameters() if grouped.get(id(p))} == muon_names, "the same split"
    for step in range(STEPS):
        loss = loss_of(model, global_batch(step, WORLD))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert abs(loss.item() - ref_losses[step]) <= 1e-10 * max(1.0, abs(ref_losses[step])), step
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[name], rtol=1e-10, atol=1e-10,
                                   msg=lambda m, n=name: f"{n}: {m}")
