"""AutoSP trains exactly like one process on the whole sequence (gloo ranks, float64, 10 AdamW steps with clipping).

One launch of 4 ranks runs every layout, so the suite pays for one start:

- tiny Llama at sp 4 (each of the 2 KV heads copied twice so 4 ranks get whole heads), ZeRO stage 1, 2
  micro-batches per step; batches plain, padded and packed;
- tiny Llama at sp 2 x 2 batches (the gradient summed over 4 data ranks, divided by 2 batches), ZeRO stage 3,
  eager attention (plain and packed batches: transformers' own eager attention turns a float64 fully padded
  row into NaN);
- tiny Qwen2 with a sliding-window layer at sp 4, ZeRO stage 2 with the optimizer offloaded and activation
  checkpointing (the attention recomputed in backward), 2 micro-batches, every kind of batch;
- Muon (matrices) with Adam (the rest) at sp 2 x 2 batches, ZeRO stage 2 (ZeRO's Muon tests' reference loop);
- sp 2 x tp 2 and sp 2 x ep 2 on a tiny Qwen3-MoE (stages 2 and 3);
- refusals at run time: a mask of the local length, meshes whose sizes do not divide;
- at sp 1 the layer changes nothing: same model object, no hook, attention implementation untouched, no
  collective in a forward and backward, bitwise the same gradients.

Each rank's loss is its tokens' cross entropy over the token count of its whole sequence group, so the
sum over a sequence group is the loss of the whole sequences; the reference computes the loss of the
unsplit batch from its logits, so a wrong label shift or mask anywhere changes the numbers.
"""

from __future__ import annotations

import autosp_testlib as lib
import pytest
import torch
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(300)

RUNS = {
    # name: (family, config, batch kinds, attention implementation, data-parallel shares)
    "llama_sp4_z1": ("llama", lib.engine_config(1, 4, 2), lib.KINDS, "sdpa", 1),
    "llama_sp2_dp2_z3_eager": ("llama", lib.engine_config(3, 2, 1), ("plain", "packed"), "eager", 2),
    "qwen2_sliding_sp4_z2": ("qwen2_sliding", lib.engine_config(2, 4, 2, offload=True, recompute=True), lib.KINDS,
                             "sdpa", 1),
    "llama_sp2_dp2_muon_z2": ("llama", lib.muon_config(2, 2), lib.KINDS, "sdpa", 2),
    "moe_sp2_tp2_z2": ("qwen3_moe", lib.engine_config(2, 2, 1, tp=2), lib.KINDS, "sdpa", 1),
    "moe_sp2_ep2_z3": ("qwen3_moe", lib.engine_config(3, 2, 1, ep=2), lib.KINDS, "sdpa", 2),
}


def noop_at_sp1(rank: int) -> dict:
    """sp 1: the model is returned as it is and runs without a collective; gradients bitwise those without it."""
    from polyaccel import ConfigError, InvalidArgument
    from polyaccel.comm.mesh import init_parallel_mesh
    from polyaccel.comm.tracing import CommTracer
    from polyaccel.engines.autosp import apply_sequence_parallel

    mesh = init_parallel_mesh(sequence=1)
    plain, model = lib.llama(), lib.llama()
    hooks = dict(model.model._forward_pre_hooks)
    same = apply_sequence_parallel(model, {"autosp_size": 1}, mesh) is model
    b = lib.batch(0, 1)  # padded
    with CommTracer() as tracer:
        for m in (plain, model):
            m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.sum().backward()
    # the control: at sp 4 the same forward and backward make 2 all-to-alls per layer each way
    split = apply_sequence_parallel(lib.llama(), {"autosp_size": 4}, init_parallel_mesh(sequence=4))
    q = lib.SEQ // 4
    with CommTracer() as control:
        split(input_ids=b["input_ids"][:, rank * q:(rank + 1) * q], attention_mask=b["attention_mask"],
              position_ids=torch.arange(rank * q, rank * q + q).expand(lib.ROWS, q)).logits.sum().backward()
    refusals = []
    for call in (lambda: split(input_ids=b["input_ids"][:, :q], attention_mask=b["attention_mask"][:, :q]),
                 lambda: init_parallel_mesh(sequence=3), lambda: init_parallel_mesh(sequence=4, expert=2)):
        try:
            call()
        except (ConfigError, InvalidArgument) as exc:
            refusals.append(str(exc))
    return {"refusals": refusals, "same_object": same, "hooks_unchanged": dict(model.model._forward_pre_hooks) == hooks,
            "impl": model.config._attn_implementation, "collectives": len(tracer.events),
            "control": sorted(e.op for e in control.events),
            "grads_equal": all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters(),
                                                                          strict=True))}


def all_runs(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {"noop": noop_at_sp1(rank)}
    for name, (family, cfg, kinds, impl, _) in RUNS.items():
        out[name] = lib.train(family, cfg, kinds, impl)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(all_runs, 4, timeout=280)


@pytest.mark.parametrize("name", list(RUNS))
def test_training_matches_the_whole_sequence_on_one_process(runs, name):
    family, cfg, kinds, impl, shares = RUNS[name]
    if cfg["optimizer"]["type"] == "muon":
        ref = lib.muon_reference(family, shares, kinds)
    else:
        ref = lib.reference(family, shares, cfg["gradient_accumulation_steps"], kinds, impl)
    for rank, res in enumerate(runs):
        lib.assert_matches(res[name], ref, f"{name} rank {rank}")


def test_mesh_places_sequence_ranks_next_to_tensor_ranks(runs):
    for rank, res in enumerate(runs):
        tp = res["moe_sp2_tp2_z2"]["coords"]  # (replica 1, expert 1, sequence 2, tensor 2)
        assert tp["tensor"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert tp["sequence"] == [rank % 2, rank % 2 + 2]
        assert tp["data"] == tp["sequence"] and tp["batch"] == [rank]
        ep = res["moe_sp2_ep2_z3"]["coords"]  # (replica 1, expert 2, sequence 2, tensor 1)
        assert ep["sequence"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert ep["expert"] == [rank % 2, rank % 2 + 2] and ep["batch"] == ep["expert"]
        assert ep["expert_data"] == ep["sequence"] and ep["data"] == [0, 1, 2, 3]
    assert "KV heads copied x2 (2 -> 4)" in runs[0]["llama_sp4_z1"]["plan"]
    assert "sequence 2" in runs[0]["moe_sp2_tp2_z2"]["plan"]


def test_sp1_is_a_strict_no_op(runs):
    for res in runs:
        refusals = res["noop"].pop("refusals")
        assert len(refusals) == 3, refusals
        assert "attention_mask must be the whole sequence's 2-D [batch, seq] padding mask (2 x 16" in refusals[0]
        assert "sequence=3 must divide data=4" in refusals[1] and "[1, 2, 4]" in refusals[1]
        assert "expert=2 must divide the batch ranks data / sequence = 4 / 4 = 1" in refusals[2]
        control = res["noop"].pop("control")
        assert control == ["all_gather_into_tensor"] + ["all_to_all_single"] * 8, control
        assert res["noop"] == {"same_object": True, "hooks_unchanged": True, "impl": "sdpa", "collectives": 0,
                               "grads_equal": True}
