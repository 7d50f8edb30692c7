"""ZeRO in a world of one: what the engine skips there must not change a number.

Stage 3 gathers in place (a module's fetch is one cast of its master elements, no prefetch, no
gather bookkeeping); an all-reduce in a group of one is a copy where the tensor is (never the
backend); and without clipping or loss scaling the gradient norm stays on the device until it is
read. Each stage still trains like plain single-process AdamW in float64, with clipping (the norm
read at once) and without (read later), and in bf16 stage 3 takes exactly stage 1's steps.
"""

from __future__ import annotations

import pytest
import torch
from zero_testlib import build_model, global_batch, loss_of, reference_run, zero_config

STEPS = 4


def _train(config, dtype, steps=STEPS):
    import polyaccel

    engine = polyaccel.initialize(build_model("llama", dtype), config)
    losses, norms, lazy = [], [], []
    try:
        for step in range(steps):
            loss = loss_of(engine, global_batch(step, 1))
            engine.backward(loss)
            assert engine.step() is True
            lazy.append(isinstance(engine._grad_norm, torch.Tensor))
            norms.append(engine.get_global_grad_norm())
            losses.append(loss.item())
        params = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
    finally:
        engine.destroy()
    return losses, params, norms, lazy


@pytest.fixture
def no_backend_all_reduce(monkeypatch):
    from polyaccel import comm

    def refuse(*args, **kwargs):
        raise AssertionError("an all-reduce in a world of one reached the communication backend")

    monkeypatch.setattr(comm, "all_reduce", refuse)


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["norm-read-later", "clipped"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world_of_one_trains_like_adamw_in_float64(stage, clip, no_backend_all_reduce):
    ref_losses, ref_params, ref_norms = reference_run("llama", torch.float64, STEPS, 1, clip=clip)
    losses, params, norms, lazy = _train(zero_config(stage, clip=clip), torch.float64)
    # the norm is left on the device exactly when nothing in the step needs it
    assert lazy == [clip == 0.0] * STEPS
    for got, want in zip(losses, ref_losses, strict=True):
        assert got == pytest.approx(want, rel=1e-10, abs=1e-12)
    for got, want in zip(norms, ref_norms, strict=True):
        assert isinstance(got, float) and got == pytest.approx(want, rel=1e-10)
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_stage3_in_place_equals_stage1_in_bf16():
    """bf16 parameters cast from the fp32 master per module (stage 3) or kept between steps (stage 1): the same
    values, the same gradients, the same steps, bit for bit (the norms are summed in another order)."""
    bf16 = {"bf16": {"enabled": True}}
    one = _train(zero_config(1, **bf16), torch.float32)
    three = _train(zero_config(3, **bf16), torch.float32)
    assert one[0] == three[0]
    assert three[2] == pytest.approx(one[2], rel=1e-6)
    for name, want in one[1].items():
        assert torch.equal(three[1][name], want), name


def test_destroy_frees_the_master_of_in_place_gathers():
    """Stage 3 in a world of one keeps parameter-shaped views of the master for its gathers: destroy re-points them
    at the parameters' own copies, so the master's memory really goes back."""
    import gc
    import weakref

    import polyaccel

    engine = polyaccel.initialize(build_model("llama", torch.float32), zero_config(3, **{"bf16": {"enabled": True}}))
    loss = loss_of(engine, global_batch(0, 1))
    engine.backward(loss)
    engine.step()
    master = weakref.ref(engine.partitioner.master)
    infos = list(engine.partitioner.infos.values())
    engine.destroy()
    gc.collect()
    assert master() is None, "something still holds the master partition"
    assert all(i.whole.dtype == torch.bfloat16 for i in infos if i.numel)
