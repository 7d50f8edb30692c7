"""The Muon step's code paths take the same steps: per-round buffers (the partition on the device), kept
buffers prepared whole after backward, and kept buffers prepared bucket by bucket during backward (the
offloaded, overlapped step, ``finish_step`` after it).

In a world of one with an fp32 model and the bf16 iteration, the round buffers hold bf16 (the update
rounded as it is written, the result widened inside the parameter update): every path equals every other
bit for bit, and after the first step each Muon matrix equals the reference ``fused_muon`` of that matrix
alone bit for bit (same grads, same arithmetic; the batched bf16 iteration matches the one-matrix one on the
cpu plugin). On 2 gloo ranks with an fp64 model and the fp32 iteration (fp32 round buffers with holes another
rank fills, reduce-scattered), the engine stays within the fp32 iteration's rounding of the single-process
reference for several steps, on the device-partition and the overlapped offloaded path.
"""

from __future__ import annotations

import pytest
import torch
from muon_testlib import muon_config, reference_loop
from polyaccel.testing.multiprocess import run_ranks
from zero_testlib import build_model, global_batch, loss_of

pytestmark = pytest.mark.timeout(300)

STEPS = 3
#: name: (config kwargs, kept_buffers forced (None: the engine's choice))
PATHS = {
    "per-round": ({"stage": 1}, False),
    "kept, after backward": ({"stage": 1}, None),
    "offload, overlapped": ({"stage": 1, "offload": True}, None),
    "offload, after backward": ({"stage": 1, "offload": True, "overlap": False}, None),
    "stage 3 offload, overlapped": ({"stage": 3, "offload": True}, None),
}


def _config(stage, offload=False, overlap=True, **params):
    cfg = muon_config(stage, offload=offload, **params)
    if offload and not overlap:
        cfg["zero_optimization"]["offload_optimizer"]["overlap_step"] = False
    return cfg


def _train(config, dtype, steps, kept=None, rank=0, world=1):
    """Train ``steps`` steps; returns the losses, the parameters after the first and the last step, and how many
    slices ``step_slice`` prepared during backward."""
    import polyaccel

    engine = polyaccel.initialize(build_model("llama", dtype, edge=False), config)
    opt = engine.optimizer
    if kept is not None:
        opt.kept_buffers = kept
    slices = []
    real = opt.step_slice
    opt.step_slice = lambda grad, lo, hi: (slices.append((lo, hi)), real(grad, lo, hi))[1]
    losses, first = [], None
    try:
        for step in range(steps):
            ids = global_batch(step, world)[rank * 2:(rank + 1) * 2]
            loss = loss_of(engine, ids)
            engine.backward(loss)
            assert engine.step() is True
            losses.append(loss.item())
            if first is None:
                first = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
        last = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
        info = {"slices": len(slices), "rounds": len(opt.rounds), "buffer_dtype": opt.buffer_dtype}
    finally:
        engine.destroy()
    return losses, first, last, info


def _choices(params=None):
    from polyaccel.engines.zero.muon import choose_params
    from polyaccel.engines.zero.muon_config import parse_muon

    model = build_model("llama", torch.float32, edge=False)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return choose_params(model, names, parse_muon(params or {}))


def test_buffer_dtype_is_the_iterations_where_the_cast_is_plain_and_narrower():
    from polyaccel.engines.zero.muon import buffer_dtype

    f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    assert buffer_dtype(bf16, f32) == bf16
    assert buffer_dtype(f32, f64) == f32
    assert buffer_dtype(f16, f32) == f32  # float16's input is scaled to unit norm in fp32 before the cast
    assert buffer_dtype(f32, f32) == f32
    assert buffer_dtype(f64, f32) == f32  # the iteration is wider: the buffer keeps the master's dtype


def test_every_path_takes_the_same_bf16_steps_and_the_first_is_the_reference_bit_for_bit():
    torch.set_num_threads(1)
    runs = {name: _train(_config(**kw, ns_dtype="bf16"), torch.float32, STEPS, kept=kept)
            for name, (kw, kept) in PATHS.items()}
    base_losses, _, base_last, base_info = runs["per-round"]
    assert base_info["buffer_dtype"] == torch.bfloat16 and base_info["rounds"] > 1
    for name, (losses, _, last, _) in runs.items():
        if name.startswith("stage 3"):
            continue  # another partition (sharded per parameter): its Adam sums differ in order
        assert losses == base_losses, name
        for key, want in base_last.items():
            assert torch.equal(last[key], want), f"{name}: {key} differs from the per-round path"
    for name, (_, _, _, info) in runs.items():
        # overlapped: prepared bucket by bucket during backward (2000-element buckets); else one slice a step
        assert (info["slices"] > STEPS) == name.endswith(", overlapped"), (name, info["slices"])

    model = build_model("llama", torch.float32, edge=False)
    choices = _choices()
    _, ref = reference_loop(model, lambda m, step: loss_of(m, global_batch(step, 1)), 1, choices,
                            hp={"ns_dtype": "bf16"})
    for name, (_, first, _, _) in runs.items():
        for key, want in ref.items():
            if choices[key].muon:
                assert torch.equal(first[key], want), f"{name}: Muon matrix {key} after one step"
            else:
                torch.testing.assert_close(first[key], want, rtol=1e-6, atol=1e-7)


def _two_ranks(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, kw in {"s1": {"stage": 1}, "s2-offload": {"stage": 2, "offload": True}}.items():
        losses, _, last, info = _train(_config(**kw, ns_dtype="fp32"), torch.float64, STEPS, rank=rank,
                                       world=world)
        out[name] = (losses, last if rank == 0 else None, info)
    return out


def test_fp32_round_buffers_with_holes_over_two_ranks_stay_within_the_iterations_rounding():
    results = run_ranks(_two_ranks, 2, timeout=240)
    torch.set_num_threads(1)
    model = build_model("llama", torch.float64, edge=False)
    ref_losses, ref = reference_loop(model, lambda m, step: loss_of(m, global_batch(step, 2)), STEPS, _choices(),
                                     hp={"ns_dtype": "fp32"})
    for name, (losses, last, info) in results[0].items():
        assert info["buffer_dtype"] == torch.float32 and info["rounds"] > 1, name
        assert (info["slices"] > STEPS) == name.endswith("offload"), (name, info["slices"])
        rank1_losses = results[1][name][0]
        for a, b, want in zip(losses, rank1_losses, ref_losses, strict=True):
            assert (a + b) / 2 == pytest.approx(want, rel=1e-6), name
        for key, want in ref.items():
            # the fp32 iteration's rounding (1e-6 of an update of lr 0.02 a step): a stale or unzeroed hole
            # would add whole updates
            torch.testing.assert_close(last[key], want, rtol=0, atol=1e-6,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")


def test_a_16_bit_gradient_takes_the_same_steps_on_the_device_and_the_host_paths():
    """Under bf16 mixed precision with one micro-step the gradient partition is bf16: the device path widens the
    pieces in one multi-tensor copy and forms the update over them; the kept buffers' path widens piece by
    piece through its scratch buffer. The same numbers, bit for bit."""
    torch.set_num_threads(1)
    config = _config(1, ns_dtype="bf16")
    config["bf16"] = {"enabled": True}
    device = _train(config, torch.float32, 2, kept=False)
    host = _train(config, torch.float32, 2, kept=True)
    assert device[0] == host[0]
    for key, want in host[2].items():
        assert torch.equal(device[2][key], want), key
