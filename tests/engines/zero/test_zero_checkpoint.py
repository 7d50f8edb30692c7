"""ZeRO checkpoints (save/resume, injected crash mid-save, consolidation, world 2 -> 1, stage 3 -> 2)
and mixed precision (bf16; fp16 with dynamic loss scaling and skipped steps), on 2 gloo ranks."""

from __future__ import annotations

import json
import math

import pytest
import torch
from polyaccel.testing.multiprocess import run_ranks
from safetensors.torch import load_file
from zero_testlib import batch, build_model, global_batch, loss_of, reference_run, train_engine, zero_config

pytestmark = pytest.mark.timeout(300)

F64 = torch.float64


class InjectedCrash(RuntimeError):
    pass


def _crash_after_rank_files(phase):
    if phase == "rank_files":
        raise InjectedCrash("simulated crash after the rank files were written")


def checkpoint_run(rank: int, world: int, ckpt: str, ckpt2: str) -> dict:
    import polyaccel
    from polyaccel.engines.zero import checkpoint

    torch.set_num_threads(1)
    out: dict = {}
    cfg3 = zero_config(3, persistence=100)
    eng = polyaccel.initialize(build_model("llama", F64), cfg3)
    losses = train_engine(eng, 3, rank)
    assert eng.save_checkpoint(ckpt, client_state={"step": 3}) == "global_step3"
    losses += train_engine(eng, 2, rank, start=3)

    # a save that dies after the rank files are written leaves the previous checkpoint as `latest`
    checkpoint._FAULT = _crash_after_rank_files
    try:
        eng.save_checkpoint(ckpt, tag="broken")
        out["crashed"] = False
    except InjectedCrash:
        out["crashed"] = True
    finally:
        checkpoint._FAULT = None
    eng.coll.barrier()
    resumed = polyaccel.initialize(build_model("llama", F64, seed=99), cfg3)
    out["client_after_crash"] = resumed.load_checkpoint(ckpt)
    out["steps_after_crash"] = resumed.global_steps
    out["loss_after_crash"] = train_engine(resumed, 1, rank, start=3)[0]
    resumed.destroy()

    eng.save_checkpoint(ckpt, client_state={"step": 5})
    out["params_at_5"] = eng.full_state_dict()
    losses += train_engine(eng, 5, rank, start=5)
    out["losses"] = losses
    out["final"] = eng.full_state_dict()
    eng.destroy()

    # resume in a fresh engine (different init) from `latest`: identical continuation
    eng = polyaccel.initialize(build_model("llama", F64, seed=123), cfg3)
    out["client_state"] = eng.load_checkpoint(ckpt)
    out["resumed_steps"] = (eng.global_steps, eng.micro_steps)
    out["resumed_losses"] = train_engine(eng, 5, rank, start=5)
    out["resumed_final"] = eng.full_state_dict()
    eng.destroy()

    # the stage-3 checkpoint loads into a stage-2 engine (resharded through full tensors); save it again
    eng = polyaccel.initialize(build_model("llama", F64, seed=7), zero_config(2))
    eng.load_checkpoint(ckpt)
    out["stage2_losses"] = train_engine(eng, 5, rank, start=5)
    eng.save_checkpoint(ckpt2)
    out["stage2_final"] = eng.full_state_dict()
    eng.destroy()
    return out


def precision_run(rank: int, world: int) -> dict:
    import polyaccel

    torch.set_num_threads(1)
    out = {}
    eng = polyaccel.initialize(build_model("llama", torch.float32), zero_config(2, bf16={"enabled": True}))
    out["bf16_dtype"] = str(next(eng.module.parameters()).dtype)
    out["bf16_master"] = str(eng.partitioner.master.dtype)
    out["bf16_losses"] = train_engine(eng, 10, rank)
    eng.destroy()

    fp16 = {"enabled": True, "initial_scale_power": 16, "hysteresis": 1, "loss_scale_window": 1000}
    eng = polyaccel.initialize(build_model("llama", torch.float32), zero_config(3, fp16=fp16, clip=1.0))
    scales, stepped, unchanged_when_skipped = [], [], []
    for step in range(10):
        before = eng.partitioner.master.clone()
        scales.append(eng.loss_scale)
        loss = loss_of(eng, batch(step, rank))
        eng.backward(loss)
        did = eng.step()
        stepped.append(did)
        if not did:
            unchanged_when_skipped.append(torch.equal(before, eng.partitioner.master))
    out.update(fp16_scales=scales, fp16_stepped=stepped, fp16_unchanged=unchanged_when_skipped,
               fp16_skipped=eng.skipped_steps, fp16_global_steps=eng.global_steps,
               fp16_loss=train_engine(eng, 1, rank, start=10)[0])
    eng.destroy()
    return out


def load_at_world_one(rank: int, world: int, ckpt: str) -> dict:
    """A world-size-2 stage-3 checkpoint continued by one process (stage 1) on the same global batches."""
    import polyaccel

    torch.set_num_threads(1)
    eng = polyaccel.initialize(build_model("llama", F64, seed=5), zero_config(1))
    client = eng.load_checkpoint(ckpt)
    losses = []
    for step in range(5, 10):
        loss = loss_of(eng, global_batch(step, 2))
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return {"client": client, "losses": losses, "final": eng.full_state_dict()}


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero_ckpt")
    return str(root / "run"), str(root / "stage2")


@pytest.fixture(scope="module")
def ckpt_results(ckpt_dirs):
    return run_ranks(checkpoint_run, 2, *ckpt_dirs, timeout=280)


def _assert_same(a: dict, b: dict, tol: float, what: str):
    assert set(a) == set(b), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=lambda m, k=k: f"{what}: {k}: {m}")


def test_resume_equals_uninterrupted_run(ckpt_results):
    for res in ckpt_results:
        assert res["client_state"] == {"step": 5}
        assert res["resumed_steps"] == (5, 5)
        assert res["resumed_losses"] == res["losses"][5:]  # bitwise: same world, same layout
    _assert_same(ckpt_results[0]["resumed_final"], ckpt_results[0]["final"], 0.0, "resumed vs uninterrupted")


def test_crash_mid_save_leaves_previous_checkpoint(ckpt_results, ckpt_dirs):
    from pathlib import Path

    for res in ckpt_results:
        assert res["crashed"]
        assert res["client_after_crash"] == {"step": 3}
        assert res["steps_after_crash"] == 3
        assert res["loss_after_crash"] == res["losses"][3]
    root = Path(ckpt_dirs[0])
    assert not (root / "broken").exists()  # the interrupted save never became a checkpoint
    assert (root / "latest").read_text() == "global_step5"


def test_stage3_checkpoint_loads_into_stage2(ckpt_results):
    res = ckpt_results[0]
    for a, b in zip(res["stage2_losses"], res["losses"][5:], strict=True):
        assert a == pytest.approx(b, rel=1e-10, abs=1e-10)
    _assert_same(res["stage2_final"], res["final"], 1e-10, "stage 2 continuation")


def test_consolidation_equals_single_process_state_dict(ckpt_results, ckpt_dirs, tmp_path):
    from polyaccel.cli import main

    torch.set_num_threads(1)
    out = tmp_path / "full.safetensors"
    assert main(["zero-to-fp32", ckpt_dirs[0], str(out), "--tag", "global_step5", "--progress"]) == 0
    full = load_file(str(out))
    _, ref_state, _ = reference_run("llama", F64, 5, 2)
    assert set(full) == set(ref_state)  # every key of the model's state_dict, buffers and frozen included
    _assert_same(full, {k: v.to(full[k].dtype) for k, v in ref_state.items()}, 1e-10, "consolidated vs reference")
    # bitwise equal to what the live engine held at the save
    for k, v in ckpt_results[0]["params_at_5"].items():
        assert torch.equal(full[k], v), k
    # a stage-2 (flat layout) checkpoint consolidates too
    out2 = tmp_path / "full2"
    out2.mkdir()
    assert main(["zero-to-fp32", ckpt_dirs[1], str(out2)]) == 0
    full2 = load_file(str(out2 / "model.safetensors"))
    for k, v in ckpt_results[0]["stage2_final"].items():
        assert torch.equal(full2[k], v), k


def test_world_two_checkpoint_loads_at_world_one(ckpt_results, ckpt_dirs):
    (res,) = run_ranks(load_at_world_one, 1, ckpt_dirs[0], timeout=120)
    assert res["client"] == {"step": 5}
    for a, b in zip(res["losses"], ckpt_results[0]["losses"][5:], strict=True):
        assert a == pytest.approx(b, rel=1e-10, abs=1e-10)
    _assert_same(res["final"], ckpt_results[0]["final"], 1e-10, "world 1 continuation")


def test_checkpoint_files_are_safetensors_per_rank(ckpt_results, ckpt_dirs):
    from pathlib import Path

    folder = Path(ckpt_dirs[0]) / "global_step5"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["meta.json", "model_states.safetensors", "zero_rank_00000.safetensors",
                     "zero_rank_00001.safetensors"]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["zero_stage"] == 3 and meta["global_steps"] == 5
    shard = load_file(str(folder / "zero_rank_00001.safetensors"))
    assert set(shard) == {"master", "exp_avg", "exp_avg_sq"}
    assert not list(Path(ckpt_dirs[0]).glob(".*.tmp-*"))  # no temporary file left behind


@pytest.fixture(scope="module")
def precision():
    return run_ranks(precision_run, 2, timeout=200)


def test_bf16_trains_close_to_fp32(precision):
    torch.set_num_threads(1)
    ref_losses, _, _ = reference_run("llama", torch.float32, 10, 2)
    res = precision[0]
    assert res["bf16_dtype"] == "torch.bfloat16" and res["bf16_master"] == "torch.float32"
    for a, b in zip(res["bf16_losses"], ref_losses, strict=True):
        assert abs(a - b) <= 2e-2 * abs(b)


def test_fp16_dynamic_loss_scale_skips_overflowing_steps(precision):
    for res in precision:
        skipped = res["fp16_stepped"].count(False)
        assert skipped >= 1 and res["fp16_skipped"] == skipped and res["fp16_global_steps"] == 10
        assert all(res["fp16_unchanged"])  # a skipped step leaves the master weights alone
        # hysteresis 1: each overflow halves the scale; no growth within the window
        assert res["fp16_scales"][0] == 2.0 ** 16
        assert res["fp16_scales"][-1] == 2.0 ** (16 - (skipped - (0 if res["fp16_stepped"][-1] else 1)))
        assert res["fp16_stepped"][skipped:] == [True] * (10 - skipped)  # overflow only while the scale was too big
        assert math.isfinite(res["fp16_loss"]) and res["fp16_loss"] < 4.2


def _kill_self(phase):
    if phase == "commit":  # everything of the new checkpoint is on disk, nothing is renamed into place yet
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def save_then_die(rank: int, world: int, ckpt: str) -> None:
    import polyaccel
    from polyaccel.engines.zero import checkpoint

    torch.set_num_threads(1)
    eng = polyaccel.initialize(build_model("gpt2", torch.float32, edge=False), zero_config(2))
    train_engine(eng, 1, rank)
    eng.save_checkpoint(ckpt, client_state={"good": True})
    train_engine(eng, 1, rank, start=1)
    checkpoint._FAULT = _kill_self
    eng.save_checkpoint(ckpt, tag="doomed")


def test_process_killed_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    from pathlib import Path

    from polyaccel.engines.zero.consolidate import consolidate
    from polyaccel.testing.multiprocess import RankFailure

    ckpt = tmp_path / "ckpt"
    with pytest.raises(RankFailure):
        run_ranks(save_then_die, 1, str(ckpt), timeout=120)
    assert (Path(ckpt) / ".doomed.partial" / "meta.json").is_file()  # the kill came after every file was written
    assert not (Path(ckpt) / "doomed").exists()
    assert (Path(ckpt) / "latest").read_text() == "global_step1"
    state = consolidate(ckpt)
    assert set(state) == set(build_model("gpt2", torch.float32, edge=False).state_dict())
