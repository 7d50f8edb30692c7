"""ZeRO stages 1-3 (with and without CPU offload) on 2 gloo ranks against single-process training.

One spawned run trains every configuration in turn (tiny HF Llama in float64, tiny GPT2 in
float32) and reports losses, gathered parameters, partition sizes, resident parameter
elements and the traced collective schedule of one step; the parent compares them with plain
``torch.optim`` training on the concatenated global batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from polyaccel.testing.multiprocess import run_ranks
from zero_testlib import build_model, reference_run, train_engine, zero_config

pytestmark = pytest.mark.timeout(300)

STEPS = 10
WORLD = 2

# name: (model kind, dtype, config kwargs, reference kwargs); LAMB in fp32 because the cpu lamb op computes
# in fp32 for any dtype
CASES = {
    "llama-s1": ("llama", torch.float64, {"stage": 1}, {}),
    "llama-s1-offload": ("llama", torch.float64, {"stage": 1, "offload": True}, {}),
    "llama-s2": ("llama", torch.float64, {"stage": 2}, {}),
    "llama-s2-offload": ("llama", torch.float64, {"stage": 2, "offload": True}, {}),
    # partial offload: the last-arriving buckets stepped on the device, the rest on the host under backward
    "llama-s2-offload-ratio": ("llama", torch.float64, {"stage": 2, "offload": True, "ratio": 0.5}, {}),
    # accumulation into both places, the norm from both parts, clipping
    "llama-s1-gas2-offload-ratio": ("llama", torch.float64, {"stage": 1, "gas": 2, "offload": True, "ratio": 0.5},
                                    {"gas": 2}),
    "llama-s2-gas2-clip-offload-ratio": ("llama", torch.float64,
                                         {"stage": 2, "gas": 2, "clip": 0.05, "offload": True, "ratio": 0.4},
                                         {"gas": 2, "clip": 0.05}),
    "llama-s3": ("llama", torch.float64, {"stage": 3}, {}),
    "llama-s3-offload": ("llama", torch.float64, {"stage": 3, "offload": True}, {}),
    "llama-s3-offload-ratio": ("llama", torch.float64, {"stage": 3, "offload": True, "ratio": 0.5}, {}),
    "llama-s3-offload-param": ("llama", torch.float64, {"stage": 3, "offload": True, "offload_param": True}, {}),
    "llama-s3-persist": ("llama", torch.float64, {"stage": 3, "persistence": 100}, {}),
    # each decoder layer (2208 elements) gathered whole; with the offloaded step overlapping backward
    "llama-s3-granular": ("llama", torch.float64, {"stage": 3, "granularity": 3000}, {}),
    "llama-s3-granular-offload": ("llama", torch.float64, {"stage": 3, "granularity": 3000, "offload": True}, {}),
    # recomputation inside backward; non-reentrant checkpointing aborts it early from inside a module
    "llama-actckpt-s3": ("llama-actckpt", torch.float64, {"stage": 3}, {}),
    "llama-actckpt-s2": ("llama-actckpt", torch.float64, {"stage": 2}, {}),
    "llama-s2-gas2": ("llama", torch.float64, {"stage": 2, "gas": 2}, {"gas": 2}),
    "llama-s1-gas2-clip": ("llama", torch.float64, {"stage": 1, "gas": 2, "clip": 0.05}, {"gas": 2, "clip": 0.05}),
    "llama-s3-gas2-clip": ("llama", torch.float64, {"stage": 3, "gas": 2, "clip": 0.05}, {"gas": 2, "clip": 0.05}),
    "llama-s2-lion": ("llama", torch.float64, {"stage": 2, "opt": "lion", "lr": 1e-3}, {"opt": "lion", "lr": 1e-3}),
    "llama-s3-lamb": ("llama", torch.float32, {"stage": 3, "opt": "lamb"}, {"opt": "lamb"}),
    "llama-s1-lamb-offload": ("llama", torch.float32, {"stage": 1, "opt": "lamb", "offload": True}, {"opt": "lamb"}),
    "gpt2-s1": ("gpt2", torch.float32, {"stage": 1}, {}),
    "gpt2-s2-offload": ("gpt2", torch.float32, {"stage": 2, "offload": True}, {}),
    "gpt2-s3": ("gpt2", torch.float32, {"stage": 3}, {}),
    "gpt2-s3-offload-param": ("gpt2", torch.float32, {"stage": 3, "offload": True, "offload_param": True}, {}),
}
TRACED_STEP = 2


def _traced_step(engine, rank, step):
    """One training step with the collectives of forward, backward and step recorded separately."""
    from polyaccel.comm.tracing import CommTracer
    from zero_testlib import batch, loss_of

    phases = {}
    with CommTracer() as tracer:
        loss = loss_of(engine, batch(step, rank))
        phases["forward"] = [(e.op, e.bytes) for e in tracer.events]
        phases["forward_async"] = [e.async_op for e in tracer.events]
        tracer.clear()
        engine.backward(loss)
        phases["backward"] = [(e.op, e.bytes) for e in tracer.events]
        tracer.clear()
        engine.step()
        phases["step"] = [(e.op, e.bytes) for e in tracer.events]
    from polyaccel import comm

    total = torch.tensor([loss.item()], dtype=torch.float64)
    comm.all_reduce(total)
    return phases, total.item() / comm.get_world_size()


def train_all_cases(rank: int, world: int, names: list[str]) -> dict:
    import polyaccel

    torch.set_num_threads(1)  # two ranks on two shared cores: oversubscribed intra-op threads crawl
    out = {}
    for name in names:
        kind, dtype, kw, _ = CASES[name]
        model = build_model(kind, dtype)
        engine = polyaccel.initialize(model, zero_config(**kw))
        gas = kw.get("gas", 1)
        losses = train_engine(engine, TRACED_STEP, rank, gas=gas)
        schedule = None
        if gas == 1:
            schedule, loss = _traced_step(engine, rank, TRACED_STEP)
            losses.append(loss)
            losses += train_engine(engine, STEPS - TRACED_STEP - 1, rank, start=TRACED_STEP + 1)
        else:
            losses += train_engine(engine, STEPS - TRACED_STEP, rank, start=TRACED_STEP, gas=gas)
        res = {
            "losses": losses,
            "master_numel": engine.partitioner.master.numel(),
            "state_numel": engine.optimizer_state_elements(),
            "master_device": engine.partitioner.master.device.type,
            "host_elements": getattr(engine.partitioner.master, "host_elements", None),  # a partial offload's
            "device_param_elements": engine.partitioner.device_param_elements(),
            "schedule": schedule,
            "buckets": len(getattr(engine.partitioner.layout, "buckets", [])),
            "builder": engine.optimizer_builder,
            "grad_norm": engine.last_grad_norm,
            "params": engine.full_state_dict(),
        }
        if rank != 0:
            res.pop("params")
        out[name] = res
        engine.destroy()
    return out


def _numels(kind, dtype):
    model = build_model(kind, dtype)
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    every = [p.numel() for p in model.parameters()]
    return trainable, every


@pytest.fixture(scope="module")
def results():
    return run_ranks(train_all_cases, WORLD, list(CASES), timeout=280)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process_training(results, name):
    torch.set_num_threads(1)
    kind, dtype, kw, ref_kw = CASES[name]
    ref_losses, ref_params, ref_norms = reference_run(kind, dtype, STEPS, WORLD,
                                                      **{"lr": kw.get("lr", 1e-2), **ref_kw})
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    got = results[0][name]
    assert len(got["losses"]) == STEPS
    # the engine's global gradient norm (all-reduced partition norms) is clip_grad_norm_'s total norm
    assert got["grad_norm"] == pytest.approx(ref_norms[-1], rel=tol), name
    # fp32 parameters: elements whose true gradient is zero (GPT-2's key bias: softmax ignores it) get
    # rounding-noise gradients that Adam normalises to updates of up to lr per step, whatever the
    # reduction order; losses are held to 1e-5, parameters to a fraction of lr * steps.
    param_atol = tol if dtype == torch.float64 else 2e-4
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
        assert abs(a - b) <= tol * max(1.0, abs(b)), f"{name}: loss at step {step}: {a} vs reference {b}"
    for key, ref in ref_params.items():
        if key in got["params"]:  # (buffers are not returned)
            torch.testing.assert_close(got["params"][key].double(), ref.double(), rtol=tol, atol=param_atol,
                                       msg=lambda m, key=key: f"{name}: parameter {key}: {m}")
    assert {k for k, _ in build_model(kind, dtype).named_parameters()} <= set(got["params"])


@pytest.mark.parametrize("name", list(CASES))
def test_partition_sizes(results, name):
    kind, dtype, kw, _ = CASES[name]
    trainable, every = _numels(kind, dtype)
    n_states = 1 if kw.get("opt") == "lion" else 2
    for rank in range(WORLD):
        got = results[rank][name]
        if kw["stage"] < 3:
            assert got["master_numel"] == math.ceil(sum(trainable) / WORLD)
        else:
            assert got["master_numel"] == sum(math.ceil(n / WORLD) for n in trainable)
        assert got["state_numel"] == got["master_numel"] * (1 + n_states)
        assert got["master_device"] == "cpu"
        if "ratio" in kw:  # split near the ratio (on a bucket or parameter boundary), pieces on both sides
            assert 0 < got["host_elements"] < got["master_numel"], got["host_elements"]
            assert abs(got["host_elements"] / got["master_numel"] - kw["ratio"]) < 0.3
        else:
            assert got["host_elements"] is None
        assert got["builder"].startswith("cpu_fused_"), got["builder"]
        if kw["stage"] == 3:
            shard_elems = sum(math.ceil(n / WORLD) for n in every)
            persistent = sum(n for n in every if n <= kw.get("persistence", 0))
            # with the master on the device a trainable shard is cast from it when gathered, not stored
            frozen_shards = shard_elems - sum(math.ceil(n / WORLD) for n in trainable)
            expected = 0 if kw.get("offload_param") else shard_elems if kw.get("offload") else frozen_shards
            assert got["device_param_elements"] == expected + persistent, (
                f"{name}: {got['device_param_elements']} parameter elements resident between steps")
            assert got["device_param_elements"] <= sum(every) / WORLD + len(every) + persistent


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2].get("gas", 1) == 1 and "lamb" not in n])
def test_collective_schedule(results, name):
    kind, dtype, kw, _ = CASES[name]
    trainable, every = _numels(kind, dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    for rank in range(WORLD):
        sched = dict(results[rank][name]["schedule"])
        forward_async = sched.pop("forward_async")
        ops = {phase: [op for op, _ in events] for phase, events in sched.items()}
        nbytes = {phase: {} for phase in sched}
        for phase, events in sched.items():
            for op, b in events:
                nbytes[phase][op] = nbytes[phase].get(op, 0) + b
        buckets = results[rank][name]["buckets"]
        if kw["stage"] in (1, 2):  # stage 1 at one micro-step reduces during backward too: nothing accumulates
            assert ops["forward"] == []
            # every bucket once, in bucket order, then the agreement on buckets reopened by late gradients
            assert ops["backward"] == ["reduce_scatter_tensor"] * buckets + ["all_reduce"] and buckets >= 3
            assert ops["step"] == ["all_reduce"] + ["all_gather_into_tensor"] * buckets
        else:
            persistent = kw.get("persistence", 0)
            big = [n for n in every if n > persistent]
            assert set(ops["forward"]) == {"all_gather_into_tensor"}
            # from the second step on, the recorded module order drives asynchronous prefetches
            assert any(forward_async)
            # every partitioned parameter is gathered in forward and again in backward (its shard each time)
            assert nbytes["forward"]["all_gather_into_tensor"] >= sum(math.ceil(n / WORLD) for n in big) * size
            assert set(ops["backward"]) == {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"}
            assert ops["backward"].count("all_reduce") == 1  # the agreement on reopened buckets
            assert nbytes["backward"]["reduce_scatter_tensor"] >= sum(trainable) * size
            assert ops["backward"].count("reduce_scatter_tensor") >= 3
            # each gather is preceded by the check that every rank gathers the same parameters, and the end of
            # forward and of backward is one more check (a rank with no gather left meets its peers' next one)
            check = 4 * torch.tensor([], dtype=torch.int64).element_size()
            for phase in ("forward", "backward"):
                gathers = [b for op, b in sched[phase] if op == "all_gather_into_tensor"]
                assert gathers[-1] == check and len(gathers) % 2 == 1, phase
                assert gathers[0:-1:2] == [check] * (len(gathers) // 2), phase
            expected_step = ["all_reduce"] + (["all_gather_into_tensor"] * 2 if persistent else [])
            assert ops["step"] == expected_step
