"""Checkpoint damage as a test matrix: every file of a saved checkpoint truncated, byte-flipped and deleted,
loaded by ``engine.load_checkpoint`` and ``consolidate`` (zero-to-fp32), each refused with the file named;
plus the failed save (file-size limit) that must leave the previous checkpoint intact and ``latest``.

One small checkpoint is saved per module, in process at world size 1; each case damages a copy.
"""

from __future__ import annotations

import resource
import shutil
import signal
from pathlib import Path

import polyaccel
import pytest
import torch
from polyaccel.engines.zero.consolidate import META, MODEL_STATES, consolidate, rank_file
from polyaccel.errors import CheckpointError, PolyaccelError
from polyaccel.safe_files import dumps_checked, read_checked_json
from zero_testlib import build_model, train_engine, zero_config

pytestmark = pytest.mark.timeout(120)

F32 = torch.float32
FILES = [META, MODEL_STATES, rank_file(0)]
KEYS = set(build_model("gpt2", F32).state_dict())


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    eng = polyaccel.initialize(build_model("gpt2", F32, seed=3), zero_config(2))
    train_engine(eng, 2, 0)
    yield eng
    eng.destroy()


@pytest.fixture(scope="module")
def saved(engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "run"
    engine.save_checkpoint(root, tag="step2", client_state={"step": 2})
    return root, engine.full_state_dict()


def _copy(saved, tmp_path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(saved[0], root)
    return root


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":  # one byte in the tensor data (or, for meta.json, in its text)
        data[len(data) - 5] ^= 0x01
        path.write_bytes(data)
    elif how == "header-flipped":  # a byte of the safetensors JSON header
        data[12] ^= 0x40
        path.write_bytes(data)
    else:
        path.unlink()


def _flip_in_tensor(path: Path, key: str) -> None:
    """Flip one bit in the middle of tensor ``key``'s bytes (safetensors: 8-byte header length, JSON, data)."""
    import json

    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8:8 + n])[key]["data_offsets"]
    data[8 + n + (begin + end) // 2] ^= 0x10
    path.write_bytes(data)


def _loader(engine, verify=True):
    if verify:
        return engine
    return polyaccel.initialize(build_model("gpt2", F32, seed=3), zero_config(2, checkpoint={"verify": False}))


CASES = [(f, how) for f in FILES for how in ("truncated", "flipped", "deleted")] + [
    (MODEL_STATES, "header-flipped"), (rank_file(0), "header-flipped")]


@pytest.mark.parametrize("name, how", CASES)
def test_damaged_file_is_refused_naming_it(engine, saved, tmp_path, name, how):
    root = _copy(saved, tmp_path)
    path = root / "step2" / name
    _damage(path, how)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    with pytest.raises(CheckpointError) as load_err:
        engine.load_checkpoint(root)
    with pytest.raises(CheckpointError) as offline_err:
        consolidate(root)
    for exc in (load_err.value, offline_err.value):
        msg = str(exc)
        assert "\n" not in msg
        assert str(path) in msg and exc.path == str(path), msg
        assert ("damaged" in msg or "truncated" in msg or "missing" in msg or "lacks" in msg
                or "not found" in msg), msg
        assert "restore" in msg and "another tag" in msg, msg
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # a refused load changes nothing


def test_checks_pass_on_the_intact_checkpoint_and_load_bitwise(engine, saved, tmp_path):
    root = _copy(saved, tmp_path)
    fresh = polyaccel.initialize(build_model("gpt2", F32, seed=11), zero_config(2))
    assert fresh.load_checkpoint(root) == {"step": 2}
    for k, v in saved[1].items():
        assert torch.equal(fresh.full_state_dict()[k], v), k
    state = consolidate(root)
    for k, v in saved[1].items():
        assert torch.equal(state[k], v), k
    fresh.destroy()


def test_verify_false_skips_checksums_but_not_sizes_or_headers(engine, saved, tmp_path):
    root = _copy(saved, tmp_path)
    shard = root / "step2" / rank_file(0)
    _flip_in_tensor(shard, "master")
    loose = _loader(engine, verify=False)
    assert loose.load_checkpoint(root) == {"step": 2}  # the key's contract: the bytes are not hashed
    state = consolidate(root, verify=False)
    assert any(not torch.equal(state[k], v) for k, v in saved[1].items())  # the flipped byte came through
    _damage(shard, "truncated")
    with pytest.raises(CheckpointError, match="truncated") as err:
        loose.load_checkpoint(root)
    assert err.value.path == str(shard)
    loose.destroy()


def test_latest_empty_or_garbage(engine, saved, tmp_path):
    root = _copy(saved, tmp_path)
    for text, what in (("", "is empty"), ("\x00garbage/..", "not a checkpoint tag"), ("step9", "does not exist")):
        (root / "latest").write_text(text)
        for call in (lambda: engine.load_checkpoint(root), lambda: consolidate(root)):
            with pytest.raises(CheckpointError, match=what) as err:
                call()
            assert "complete checkpoints here: step2" in str(err.value)


def test_meta_claiming_another_world_size(engine, saved, tmp_path):
    root = _copy(saved, tmp_path)
    meta_path = root / "step2" / META
    meta, _ = read_checked_json(meta_path, "")
    meta["world_size"] = 2
    meta_path.write_text(dumps_checked(meta))  # consistent checksum, inconsistent content
    for call in (lambda: engine.load_checkpoint(root), lambda: consolidate(root)):
        with pytest.raises(CheckpointError, match=r"saved by 2 rank\(s\)") as err:
            call()
        assert str(root / "step2") in str(err.value)
    # a layout that is not the one the rank file was cut with (unverified: the checksums would catch it)
    meta["world_size"] = 1
    big = max(range(len(meta["layout"]["shapes"])), key=lambda i: torch.Size(meta["layout"]["shapes"][i]).numel())
    meta["layout"]["shapes"][big][0] *= 50
    meta_path.write_text(dumps_checked(meta))
    with pytest.raises(CheckpointError, match="do not fit the layout"):
        consolidate(root, verify=False)


def test_checkpoint_saved_without_checksums_is_refused_with_the_fix(engine, saved, tmp_path):
    root = _copy(saved, tmp_path)
    meta_path = root / "step2" / META
    meta, _ = read_checked_json(meta_path, "")
    import json

    for k in ("files", "integrity"):
        meta.pop(k)
    meta_path.write_text(json.dumps(meta, indent=1))  # what polyaccel wrote before checksums
    with pytest.raises(CheckpointError, match="saved without checksums.*checkpoint.verify = false"):
        engine.load_checkpoint(root)
    loose = _loader(engine, verify=False)
    assert loose.load_checkpoint(root) == {"step": 2}
    loose.destroy()
    assert set(consolidate(root, verify=False)) == KEYS


def test_unknown_checkpoint_key_is_rejected_with_the_allowed_list():
    with pytest.raises(PolyaccelError, match="checkpoint.verif.*allowed keys in 'checkpoint': verify"):
        polyaccel.initialize(build_model("gpt2", F32), zero_config(2, checkpoint={"verif": False}))
    with pytest.raises(PolyaccelError, match="'checkpoint.verify' must be true or false"):
        polyaccel.initialize(build_model("gpt2", F32), zero_config(2, checkpoint={"verify": "no"}))


def test_failed_save_leaves_previous_checkpoint_latest_and_nothing_behind(engine, saved, tmp_path):
    root = _copy(saved, tmp_path)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # the rank file is larger: write() fails with EFBIG
    try:
        with pytest.raises(CheckpointError) as err:
            engine.save_checkpoint(root, tag="step3")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    msg = str(err.value)
    assert "\n" not in msg and "File too large" in msg and rank_file(0) in msg, msg
    assert "'latest' still names 'step2'" in msg
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before  # nothing left behind
    assert (root / "latest").read_text() == "step2"
    assert set(consolidate(root)) == KEYS


def two_rank_damage(rank: int, world: int, root: str) -> dict:
    """Rank 1's shard damaged: both ranks refuse (no hang); rank 1 cannot write: both ranks fail the save alike."""
    import os

    from polyaccel import comm

    torch.set_num_threads(1)
    eng = polyaccel.initialize(build_model("gpt2", F32, seed=3), zero_config(3))
    train_engine(eng, 1, rank)
    eng.save_checkpoint(root, tag="step1")
    out = {}
    if rank == 1:
        shard = Path(root) / "step1" / rank_file(1)
        _flip_in_tensor(shard, "master")
    comm.barrier()
    try:
        eng.load_checkpoint(root)
    except CheckpointError as exc:
        out["load_error"], out["load_path"] = str(exc), exc.path
    comm.barrier()
    if rank == 0:
        shutil.copy(Path(root) / "step1" / rank_file(1), Path(root) / "damaged.bin")
    comm.barrier()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        eng.save_checkpoint(root, tag="step2")
    except CheckpointError as exc:
        out["save_error"] = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    comm.barrier()  # rank 0 drops the save's directory lock on its way out of the failed save: list after it
    out["left"] = sorted(os.listdir(root))
    eng.destroy()
    return out


def test_two_ranks_agree_on_a_damaged_shard_and_on_a_failed_save(tmp_path):
    from polyaccel.testing.multiprocess import run_ranks

    root = tmp_path / "run"
    results = run_ranks(two_rank_damage, 2, str(root), timeout=100)
    shard = str(root / "step1" / rank_file(1))
    for res in results:
        assert res["load_path"] == shard and "checksum mismatch" in res["load_error"], res
        assert "(on rank 1)" in res["load_error"]
        assert "saving checkpoint 'step2'" in res["save_error"] and "File too large" in res["save_error"]
        assert rank_file(1) in res["save_error"] and "'latest' still names 'step1'" in res["save_error"]
        assert res["left"] == ["damaged.bin", "latest", "step1"]  # no .step2.partial, no temporary file
    with pytest.raises(CheckpointError, match="checksum mismatch") as err:
        consolidate(root)
    assert err.value.path == shard
    # rank 1's file missing: what was saved and what is there
    (root / "step1" / rank_file(1)).unlink()
    with pytest.raises(CheckpointError, match=r"zero_rank_00001.safetensors is missing: checkpoint 'step1' was "
                                              r"saved by 2 rank\(s\).*the folder holds meta.json, "
                                              r"model_states.safetensors, zero_rank_00000.safetensors"):
        consolidate(root)
