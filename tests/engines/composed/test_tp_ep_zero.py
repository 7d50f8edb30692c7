"""ZeRO x AutoTP x AutoEP composed on one mesh through ``polyaccel.initialize`` (gloo on CPU, float64).

The model (see ``composed_testlib``): a tiny Mixtral-like Qwen3-MoE, GQA attention split over tensor,
a dense MLP layer split over tensor, a MoE layer of 4 experts placed over expert, q_norm/k_norm
whose gradients are summed over tensor, a vocabulary split over tensor.

Three starts of ranks (the 8-rank one is the slow one on 2 cores, so everything 8-rank happens in it):

- 8 ranks = dp 2 x tp 2 x ep 2 (data 4 = expert_data 2 x expert 2): ZeRO stages 1, 2 and 3 train 10
  AdamW steps with clipping; step 1 of each is traced with ``CommTracer``; the ZeRO groups each
  parameter went to are recorded; the stage-2 run saves a checkpoint after 5 steps and goes on
  (the run that never stopped).
- 4 ranks = tp 2 x ep 2 (data 2, expert_data 1): first two refusals (ep 4 does not divide data 2;
  expert_tensor_parallel_size 2), each before the model changes; stages 1, 2, 3, and stages 2 and 3 with two
  accumulation micro-steps, 10 steps each; then the checkpoint loads as tp 4 x ep 1 (stage 3; the
  2 KV heads over 4 tensor ranks leave two ranks without heads) and tp 1 x ep 4 (stage 1).
  Also stage 2 with ZeRO's dynamic loss scale (2**10, exact on float64) and an overflow on one rank at
  step 3: every rank skips that step.
- 1 rank: the checkpoint loads into the plain Hugging Face model (no layer, stage 2) and into
  tp 1 x ep 1 (stage 3).

Checked: losses and gradient norms equal single-process training (1e-10); every rank's parameters
are the reference cut by its recorded split; loaded parameters are bitwise the consolidated
checkpoint's pieces and 3 continued steps equal the run that never stopped; ``zero-to-fp32`` writes
the state dict a plain Hugging Face model loads; per-parameter metadata (layouts, ZeRO group, ranks,
copies) and the traced collectives per group.
"""

from __future__ import annotations

import pytest
import torch
from composed_testlib import (
    GLOBAL,
    MORE,
    SAVE_AT,
    STEPS,
    build,
    config,
    global_batch,
    loss_of,
    reference,
    rows,
    shared_result,
)
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(300)

TRACED = 1  # the step whose collectives are recorded
EIGHT = [1, 2, 3]  # stages at dp 2 x tp 2 x ep 2
FOUR = [(1, 1), (2, 1), (3, 1), (2, 2), (3, 2)]  # (stage, accumulation micro-steps) at tp 2 x ep 2
LOADS_FOUR = [(4, 1, 3), (1, 4, 1)]  # (tp, ep, stage) on 4 ranks
LOADS_ONE = [(None, None, 2), (1, 1, 3)]  # None: the plain Hugging Face model, no layer
DIMS = ("tensor", "expert", "data", "expert_data")
OVERFLOW_AT = 3


# --------------------------------------------------------------------------------------------- on the ranks
def _steps(engine, start: int, count: int, accum: int = 1, trace: dict | None = None,
           poison: int | None = None) -> tuple[list, list]:
    """``count`` steps from ``start``; at step ``poison`` the last rank's loss is multiplied by inf in backward
    (an overflow on one rank of one group: every rank must skip that step)."""
    from polyaccel import comm
    from polyaccel.comm.tracing import CommTracer

    mesh = engine.mesh
    d, n = (mesh.rank("data"), mesh.size("data")) if mesh is not None else (0, 1)
    last = comm.get_rank() == comm.get_world_size() - 1
    losses, norms = [], []
    for step in range(start, start + count):
        traced = trace is not None and step == TRACED
        total = 0.0
        for micro in rows(step, d, n).chunk(accum):
            with CommTracer() as fb:
                loss = loss_of(engine, micro)
                engine.backward(loss * float("inf") if step == poison and last else loss)
            with CommTracer() as st:
                engine.step()
            total += loss.item() / accum
            if traced:
                trace.setdefault("backward", []).extend(_events(fb))
                trace.setdefault("step", []).extend(_events(st))
        t = torch.tensor([total], dtype=torch.float64)
        comm.all_reduce(t)
        losses.append(t.item() / comm.get_world_size())
        norms.append(engine.last_grad_norm)
    return losses, norms


def _events(tracer) -> list[tuple[str, tuple[int, ...], int]]:
    return [(e.op, e.group_ranks, e.bytes) for e in tracer.events]


def _snapshot(engine) -> dict:
    from polyaccel.parallel import get_layout

    mesh = engine.mesh
    out = {"params": engine.full_state_dict(),
           "layouts": {n: get_layout(p) for n, p in engine.module.named_parameters()}}
    if mesh is not None:
        out["ranks"] = {dim: tuple(mesh.ranks(dim)) for dim in DIMS}
        out["coords"] = {dim: mesh.rank(dim) for dim in DIMS}
        out["groups"] = [{"key": g.key, "names": [n for n, _ in g.entries], "ranks": tuple(g.coll.global_ranks()),
                          "grad_sum": tuple(g.grad_sum.global_ranks()) if g.grad_sum is not None else None,
                          "copies": g.copies, "partition": g.partitioner.master.numel(),
                          "itemsize": g.partitioner.grad.element_size()} for g in engine.groups]
    return out


def eight_ranks(rank: int, world: int, ckpt: str) -> dict:
    import polyaccel

    torch.set_num_threads(1)
    out = {}
    for stage in EIGHT:
        cfg = config(stage, 2, 2)
        engine = polyaccel.initialize(build(), cfg)
        assert "tensor_parallel" in cfg and "expert_parallel" in cfg, "the caller's config is not modified"
        assert engine.tp_plan is not None and engine.ep_plan is not None
        trace: dict = {}
        if stage == 2:
            losses, norms = _steps(engine, 0, SAVE_AT, trace=trace)
            engine.save_checkpoint(ckpt, tag="saved")
            more = _steps(engine, SAVE_AT, STEPS - SAVE_AT)
            losses, norms = losses + more[0], norms + more[1]
        else:
            losses, norms = _steps(engine, 0, STEPS, trace=trace)
        out[stage] = {"losses": losses, "norms": norms, "trace": trace, "plan": str(engine.ep_plan),
                      "tp_notes": list(engine.tp_plan.notes), **_snapshot(engine)}
        engine.destroy()
    return out


def four_ranks(rank: int, world: int, ckpt: str) -> dict:
    import polyaccel

    torch.set_num_threads(1)
    out = {"refused": _refusals()}
    for stage, accum in FOUR:
        engine = polyaccel.initialize(build(), config(stage, 2, 2, accum))
        losses, norms = _steps(engine, 0, STEPS, accum)
        out[(stage, accum)] = {"losses": losses, "norms": norms, **_snapshot(engine)}
        engine.destroy()
    # loss scaling: ZeRO's dynamic fp16 scaler on the float64 model (powers of two scale exactly), an overflow on
    # one rank at step OVERFLOW_AT
    from polyaccel.engines.zero.config import Fp16Config
    from polyaccel.engines.zero.loss_scaler import LossScaler

    engine = polyaccel.initialize(build(), config(2, 2, 2))
    engine.scaler = LossScaler(Fp16Config(enabled=True, initial_scale_power=10, hysteresis=1))
    losses, norms = _steps(engine, 0, STEPS, poison=OVERFLOW_AT)
    out["scaled"] = {"losses": losses, "norms": norms, "scale": engine.loss_scale, "skipped": engine.skipped_steps,
                     **_snapshot(engine)}
    engine.destroy()
    out.update(_loads(ckpt, LOADS_FOUR))
    return out


def _refusals() -> list[tuple[str, bool]]:
    """Bad combinations on 4 ranks: refused by ``initialize`` before any weight changes (message, unchanged)."""
    import polyaccel

    out = []
    for cfg in (config(1, 2, 4), {**config(1, 2, 2), "expert_parallel": {"autoep_size": 2,
                                                                        "expert_tensor_parallel_size": 2}}):
        model = build()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            polyaccel.initialize(model, cfg)
            message = ""
        except polyaccel.ConfigError as exc:
            message = str(exc)
        after = model.state_dict()
        out.append((message, set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)))
    return out


def one_rank(rank: int, world: int, ckpt: str) -> dict:
    torch.set_num_threads(1)
    return _loads(ckpt, LOADS_ONE)


def _loads(ckpt: str, layouts) -> dict:
    import polyaccel

    out = {}
    for tp, ep, stage in layouts:
        engine = polyaccel.initialize(build(seed=5), config(stage, tp, ep))  # other initial weights: all must load
        engine.load_checkpoint(ckpt, tag="saved")
        snap = _snapshot(engine)
        out[(tp, ep, stage)] = {**snap, "losses": _steps(engine, SAVE_AT, MORE)[0], "steps": engine.global_steps}
        engine.destroy()
    return out


# --------------------------------------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)

    def produce():
        from polyaccel.engines.zero.consolidate import consolidate

        ckpt = str(tmp_path_factory.mktemp("tp_ep_ckpt"))
        eight = run_ranks(eight_ranks, 8, ckpt, timeout=280)
        four = run_ranks(four_ranks, 4, ckpt, timeout=200)
        one = run_ranks(one_rank, 1, ckpt, timeout=100)
        return {"ckpt": ckpt, "eight": eight, "four": four, "one": one[0],
                "full": consolidate(ckpt, tag="saved", progress=False)}

    return shared_result(tmp_path_factory, "tp_ep_zero_runs", produce)


@pytest.fixture(scope="module")
def ref():
    return reference()


def _check_training(got: list[dict], ref, what: str) -> None:
    ref_losses, ref_norms, ref_states = ref
    for step in range(STEPS):
        assert abs(got[0]["losses"][step] - ref_losses[step]) <= 1e-10, (what, step)
        for g in got:
            if ref_norms[step] == float("inf"):
                assert g["norms"][step] == float("inf"), (what, step)
                continue
            assert abs(g["norms"][step] - ref_norms[step]) <= 1e-9 * ref_norms[step], (what, step)
    for name, want in ref_states[-1].items():
        for r, g in enumerate(got):
            split = g["layouts"][name].split
            expect = want if split is None else split.piece(want)
            err = (g["params"][name] - expect).abs().max().item()
            assert err <= 1e-10, f"{what}: {name} on rank {r} off by {err:.3g}"
            if split is None:
                assert torch.equal(g["params"][name], got[0]["params"][name]), f"{what}: {name} differs on rank {r}"


@pytest.mark.parametrize("stage", EIGHT)
def test_dp2_tp2_ep2_on_8_ranks_matches_single_process(runs, ref, stage):
    got = [runs["eight"][r][stage] for r in range(8)]
    coords = {(g["coords"]["expert_data"], g["coords"]["expert"], g["coords"]["tensor"]) for g in got}
    assert coords == {(d, e, t) for d in range(2) for e in range(2) for t in range(2)}
    assert "ep=2, expert_data=2" in got[0]["plan"]
    assert any("already placed by another layer over expert" in n for n in got[0]["tp_notes"])
    _check_training(got, ref, f"8 ranks, stage {stage}")
    experts = [n for n, lay in got[0]["layouts"].items() if lay.split is not None and lay.split.dim == "expert"]
    assert len(experts) == 2
    for name in experts:  # the same expert block on the 4 ranks of each expert rank: 2 tensor x 2 expert_data
        for e in range(2):
            same = [g["params"][name] for g in got if g["coords"]["expert"] == e]
            assert len(same) == 4 and all(torch.equal(same[0], x) for x in same)


@pytest.mark.parametrize("stage, accum", FOUR)
def test_tp2_ep2_on_4_ranks_matches_single_process(runs, ref, stage, accum):
    got = [runs["four"][r][(stage, accum)] for r in range(4)]
    assert {(g["coords"]["expert"], g["coords"]["tensor"]) for g in got} == {(e, t) for e in range(2) for t in range(2)}
    _check_training(got, ref, f"4 ranks, stage {stage}, accumulation {accum}")


def test_bad_combinations_refused_before_the_model_changes(runs):
    for r in range(4):
        (mesh_error, unchanged_1), (etp_error, unchanged_2) = runs["four"][r]["refused"]
        assert unchanged_1 and unchanged_2
        assert "expert=4 must divide data=2 (world 4 / tensor 2" in mesh_error and "fit: [1, 2]" in mesh_error
        assert "expert_tensor_parallel_size' is 2: splitting expert weights over the tensor ranks" in etp_error


def test_loss_scaling_and_an_overflow_on_one_rank_skip_the_step_everywhere(runs):
    """tp 2 x ep 2, stage 2, dynamic loss scale 2**10: the overflow of one rank at step 3 skips that step on every
    rank (the scale halves once); the other steps equal single-process training that skips step 3."""
    got = [runs["four"][r]["scaled"] for r in range(4)]
    assert all(g["skipped"] == 1 and g["scale"] == 2.0 ** 9 for g in got)
    _check_training(got, reference(skip=(OVERFLOW_AT,)), "loss scaled, overflow at step 3")


# --------------------------------------------------------------------------------------------- metadata
def _expected_kind(name: str) -> tuple:
    """The layout key a parameter of the model must have: (replicas, grad_sum, split dimension)."""
    if ".experts." in name:
        return ("expert_data", None, "expert")
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return ("data", "tensor", None)
    if any(k in name for k in ("_proj.", "embed_tokens.", "lm_head.")):  # attention, dense MLP, vocabulary
        return ("data", None, "tensor")
    return ("data", None, None)  # norms and the router


def test_layers_hand_zero_one_layout_per_parameter():
    """In one process, as rank (tensor t, expert e) of tp 2 x ep 2 would: AutoEP then AutoTP (as
    ``polyaccel.initialize`` orders them) give every parameter exactly the layout its role needs, and ZeRO's
    grouping puts each in exactly one group."""
    from polyaccel.engines.autoep import detect, parse_config
    from polyaccel.engines.autoep.convert import convert
    from polyaccel.engines.autotp import apply_tensor_parallel
    from polyaccel.engines.zero.groups import group_key
    from polyaccel.parallel import DEFAULT, get_layout

    for t in range(2):
        for e in range(2):
            model = build()
            full = {n: p.detach().clone() for n, p in model.named_parameters()}
            convert(model, detect(model, parse_config({"autoep_size": 2}), 2), group=None, ep_rank=e)
            apply_tensor_parallel(model, {"autotp_size": 2}, group=None, rank=t, tp=2)
            params = dict(model.named_parameters())
            assert set(params) == set(full)
            for name, p in params.items():
                lay = get_layout(p)
                assert group_key(lay) == _expected_kind(name), name
                if lay.split is None:
                    assert lay == DEFAULT or lay.grad_sum == "tensor", name
                    assert torch.equal(p.detach(), full[name]), name
                    continue
                assert torch.equal(p.detach(), lay.split.piece(full[name])), name
                if lay.split.dim == "expert":
                    assert lay.split.sections == ((2, 2),) and lay.split.rank == e and lay.split.axis == 0
                else:
                    assert lay.split.degree == 2 and lay.split.rank == t


def _mesh_ranks(world: int, tp: int, ep: int, coords: dict, dim: str) -> set[int]:
    """Ranks of one group, from the mesh's documented order: rank = (expert_data x expert + expert) x tp + tensor."""
    ed_size = world // (tp * ep)
    ed, e, t = coords["expert_data"], coords["expert"], coords["tensor"]
    free = {"tensor": [(ed, e, x) for x in range(tp)], "expert": [(ed, x, t) for x in range(ep)],
            "expert_data": [(x, e, t) for x in range(ed_size)],
            "data": [(x, y, t) for x in range(ed_size) for y in range(ep)]}[dim]
    return {(a * ep + b) * tp + c for a, b, c in free}


@pytest.mark.parametrize("world", [8, 4])
def test_every_parameter_is_reduced_over_exactly_one_correct_group(runs, world):
    """Per rank: each trainable parameter is in one ZeRO group; the group's partition ranks are its replicas'
    dimension (data for dense, expert_data for experts), its grad_sum group the tensor ranks, and ``copies``
    counts the ranks outside the partition group that hold the same elements."""
    got = runs["eight"] if world == 8 else runs["four"]
    for r in range(world):
        snap = got[r][2] if world == 8 else got[r][(2, 1)]
        coords = snap["coords"]
        for dim in DIMS:
            assert set(snap["ranks"][dim]) == _mesh_ranks(world, 2, 2, coords, dim), (r, dim)
        names = [n for g in snap["groups"] for n in g["names"]]
        assert sorted(names) == sorted(snap["layouts"]) and len(names) == len(set(names)), "each parameter once"
        keys = [g["key"] for g in snap["groups"]]
        assert len(keys) == len(set(keys)) == 4
        for g in snap["groups"]:
            replicas, grad_sum, split = g["key"]
            assert all(_expected_kind(n) == g["key"] for n in g["names"]), g["key"]
            assert set(g["ranks"]) == _mesh_ranks(world, 2, 2, coords, replicas), (r, g["key"])
            assert g["grad_sum"] is None if grad_sum is None else set(g["grad_sum"]) == _mesh_ranks(
                world, 2, 2, coords, "tensor")
            degree = 2 if split else 1
            assert g["copies"] == world // (len(g["ranks"]) * degree), (r, g["key"])
            # the replicated parameters (norms, router, and the experts: replicated over tensor) count once in the
            # norm although tp 2 ranks hold them; the tensor-split ones are held once
            assert g["copies"] == (1 if split == "tensor" else 2)


# --------------------------------------------------------------------------------------------- traced step
def _dim_of(group: tuple[int, ...], snap: dict, world: int) -> str:
    if group == tuple(range(world)):
        return "world"
    for dim in DIMS:
        if set(group) == set(snap["ranks"][dim]):
            return dim
    raise AssertionError(f"a collective on group {group}, which is no mesh dimension of this rank")


@pytest.mark.parametrize("stage", EIGHT)
def test_traced_step_runs_each_collective_on_its_group(runs, stage):
    """Step 1 of the 8-rank run: token exchange on expert, activations on tensor, gradient reduction on data
    (dense) and expert_data (experts) with exactly the partitions' bytes (no element reduced twice, none over
    the wrong group), the grad_sum all-reduce on tensor, one world all-reduce for the norm."""
    for r in range(8):
        snap = runs["eight"][r][stage]
        trace = snap["trace"]
        by: dict[tuple[str, str, str], list[int]] = {}
        for phase in ("backward", "step"):
            for op, group, nbytes in trace[phase]:
                by.setdefault((phase, op, _dim_of(group, snap, 8)), []).append(nbytes)
        groups = snap["groups"]
        partition_bytes = {}
        for g in groups:
            partition_bytes[g["key"][0]] = partition_bytes.get(g["key"][0], 0) + g["partition"] * g["itemsize"]
        reduce_phase = "backward"  # stage 1 too: at one micro-step per boundary nothing accumulates
        # gradient reduction: every element of every partition exactly once, over its own replicas
        for dim in ("data", "expert_data"):
            group_size = len(snap["ranks"][dim])
            assert sum(by[(reduce_phase, "reduce_scatter_tensor", dim)]) == partition_bytes[dim] * group_size, dim
        allowed = {
            ("backward", "all_to_all_single", "expert"),  # MoE: the counts, the tokens, back (and backward)
            ("backward", "all_reduce", "tensor"),  # AutoTP: row outputs, vocab, loss; the input gradients
            ("step", "all_reduce", "tensor"),  # the grad_sum parameters (q_norm, k_norm)
            ("step", "all_reduce", "world"),  # the gradient norm
            ("step", "all_gather_into_tensor", "data"), ("step", "all_gather_into_tensor", "expert_data"),
            (reduce_phase, "reduce_scatter_tensor", "data"), (reduce_phase, "reduce_scatter_tensor", "expert_data"),
        }
        # the buckets' arrival flags (one small max all-reduce per group), after backward (stage 1 too: it
        # reduces during backward at one micro-step)
        allowed |= {("backward", "all_reduce", "data"), ("backward", "all_reduce", "expert_data")}
        if stage == 3:  # parameter gathers around each module (and the schedule check before each)
            allowed |= {("backward", "all_gather_into_tensor", "data"),
                        ("backward", "all_gather_into_tensor", "expert_data")}
        assert set(by) <= allowed, sorted(set(by) - allowed)
        assert len(by[("backward", "all_to_all_single", "expert")]) == 5  # one MoE layer: 3 forward, 2 backward
        grad_sum = [g for g in groups if g["key"][1] == "tensor"]
        assert by[("step", "all_reduce", "tensor")] == [grad_sum[0]["partition"] * grad_sum[0]["itemsize"]]
        assert by[("step", "all_reduce", "world")] == [8]  # one float64: the squared norm
        assert len(by[("backward", "all_reduce", "data")]) == 3  # the three dense groups
        assert len(by[("backward", "all_reduce", "expert_data")]) == 1
        gathered = {dim: sum(by.get(("step", "all_gather_into_tensor", dim), [])) for dim in ("data", "expert_data")}
        if stage < 3:  # stages 1-2 re-gather every parameter after the step: each rank sends its partition
            assert gathered == partition_bytes
        else:  # stage 3 (nothing persistent here) gathers parameters where they are used
            assert gathered == {"data": 0, "expert_data": 0}
            assert by[("backward", "all_gather_into_tensor", "expert_data")]


# --------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_consolidates_to_the_state_at_the_save(runs, ref):
    _, _, states = ref
    full = runs["full"]
    assert set(full) == set(states[SAVE_AT - 1])
    for name, want in states[SAVE_AT - 1].items():
        assert full[name].shape == want.shape, name
        assert (full[name] - want).abs().max().item() <= 1e-10, name


def _loaded(runs):
    out = {f"tp {tp} x ep {ep} (stage {stage}) on 4 ranks": [runs["four"][r][(tp, ep, stage)] for r in range(4)]
           for tp, ep, stage in LOADS_FOUR}
    for tp, ep, stage in LOADS_ONE:
        what = "the plain HF model" if tp is None else f"tp {tp} x ep {ep}"
        out[f"{what} (stage {stage}) on 1 rank"] = [runs["one"][(tp, ep, stage)]]
    return out


def test_checkpoint_loads_bitwise_in_other_layouts(runs):
    full = runs["full"]
    for what, got in _loaded(runs).items():
        for r, g in enumerate(got):
            assert g["steps"] == SAVE_AT + MORE
            assert set(g["params"]) == set(full), what
            for name, local in g["params"].items():
                split = g["layouts"][name].split
                want = full[name] if split is None else split.piece(full[name])
                assert torch.equal(local, want), f"{what}, rank {r}: {name} is not the consolidated tensor's piece"
        if what.startswith("tp 4"):
            kv = sorted(g["params"]["model.layers.0.self_attn.k_proj.weight"].shape[0] for g in got)
            assert kv == [0, 0, 8, 8]  # 2 KV heads of 8 over 4 tensor ranks: two ranks hold none


def test_continued_steps_equal_the_run_that_never_stopped(runs, ref):
    ref_losses = ref[0]
    never = runs["eight"][0][2]["losses"][SAVE_AT:SAVE_AT + MORE]
    for what, got in _loaded(runs).items():
        for step, (a, b, c) in enumerate(zip(got[0]["losses"], never, ref_losses[SAVE_AT:SAVE_AT + MORE], strict=True)):
            assert abs(a - b) <= 1e-10 and abs(a - c) <= 1e-10, (what, step, a, b, c)


def test_zero_to_fp32_of_the_composed_checkpoint_is_the_hf_state_dict(runs, ref, tmp_path, capsys):
    from polyaccel.cli import main
    from safetensors.torch import load_file

    _, _, states = ref
    out = tmp_path / "model.safetensors"
    assert main(["zero-to-fp32", runs["ckpt"], str(out), "--tag", "saved"]) == 0, capsys.readouterr().err
    plain = build(seed=3)
    plain.load_state_dict(load_file(str(out)), strict=True)
    saved = build(seed=4)
    saved.load_state_dict(states[SAVE_AT - 1])
    ids = global_batch(SAVE_AT)
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - saved(input_ids=ids).logits).abs().max().item() <= 1e-10
    assert GLOBAL % 4 == 0  # (every layout above splits the global batch evenly over its data ranks)
