"""`polyaccel train --save/--resume`, `zero-to-fp32` and `checkpoint verify` on damaged checkpoints and failed
saves, end to end (2 ranks on the cpu plugin over gloo): one line naming the file, nothing half-written left."""

import json
import os
import resource
import shutil
import signal

import pytest
from polyaccel.apps.train.run_records import TRAIN_LOCK
from polyaccel.cli import main
from polyaccel.dir_lock import DirectoryLock
from polyaccel.safe_files import dumps_checked, read_checked_json

TINY = ["--hidden-size", "64", "--layers", "1", "--heads", "2", "--batch-size", "4", "--seq-len", "32",
        "--threads", "1", "--lr", "1e-2"]

pytestmark = pytest.mark.timeout(240)


def _flip_master(path):
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8:8 + n])["master"]["data_offsets"]
    data[8 + n + (begin + end) // 2] ^= 0x10
    path.write_bytes(data)


def _one_error_line(err: str, prog: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"polyaccel {prog}"), err
    return lines[0]


def test_damaged_checkpoint_and_failed_save_end_to_end(capfd, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert main(["train", *TINY, "--steps", "4", "--save", str(ckpt)]) == 0
    capfd.readouterr()
    assert main(["checkpoint", "verify", str(ckpt)]) == 0
    assert "ok: " in capfd.readouterr().out

    # another run's metadata file beside this run's step4/ (its own checksum intact): both readers refuse
    meta = ckpt / "train-meta-step4.json"
    good_meta = meta.read_bytes()
    other, _ = read_checked_json(meta, "")
    meta.write_text(dumps_checked({**other, "seed": 99, "run_id": "0" * 32}))
    assert main(["checkpoint", "verify", str(ckpt)]) == 1
    line = _one_error_line(capfd.readouterr().err, "checkpoint verify")
    assert str(meta) in line and "do not belong to one save" in line
    assert main(["train", *TINY, "--steps", "6", "--resume", str(ckpt)]) == 2
    line = _one_error_line(capfd.readouterr().err, "train")
    assert "come from two different runs" in line and "seed: 99 in the metadata file, 1234 in the checkpoint" in line
    meta.write_bytes(good_meta)

    # a second run writing the same --save directory while the first holds it: refused before it starts
    before = sorted(p.name for p in ckpt.iterdir())
    with DirectoryLock(ckpt, TRAIN_LOCK, "polyaccel train --save"):
        assert main(["train", *TINY, "--steps", "6", "--resume", str(ckpt), "--save", str(ckpt)]) == 2
    line = _one_error_line(capfd.readouterr().err, "train")
    assert f"--save {ckpt}: {ckpt} is being written by polyaccel train --save (pid {os.getpid()}" in line
    assert sorted(p.name for p in ckpt.iterdir()) == before

    # the train app's metadata file: refused before any rank starts
    meta.write_bytes(good_meta.replace(b'"seed": 1234', b'"seed": 1235'))
    assert main(["train", *TINY, "--steps", "6", "--resume", str(ckpt)]) == 2
    line = _one_error_line(capfd.readouterr().err, "train")
    assert str(meta) in line and "checksum mismatch" in line
    assert main(["checkpoint", "verify", str(ckpt)]) == 1
    assert str(meta) in _one_error_line(capfd.readouterr().err, "checkpoint verify")
    meta.write_bytes(good_meta)

    # one flipped bit in rank 1's master weights: every reader refuses, naming the file
    shard = ckpt / "step4" / "zero_rank_00001.safetensors"
    good = tmp_path / "good.safetensors"
    shutil.copy(shard, good)
    _flip_master(shard)
    assert main(["zero-to-fp32", str(ckpt), str(tmp_path / "out.safetensors")]) == 1
    line = _one_error_line(capfd.readouterr().err, "zero-to-fp32")
    assert str(shard) in line and "checksum mismatch" in line
    assert not (tmp_path / "out.safetensors").exists()
    # (the ranks of `train --resume` run engine.load_checkpoint: tests/engines/zero/test_checkpoint_damage.py)
    shutil.copy(good, shard)

    # a save that hits the file-size limit: one line, the partial state removed, step4 still `latest`
    before = sorted(p.name for p in ckpt.iterdir())
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # inherited by the ranks: write() fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, hard))
    try:
        rc = main(["train", *TINY, "--steps", "5", "--resume", str(ckpt), "--save", str(ckpt)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert rc == 2
    line = _one_error_line(capfd.readouterr().err, "train")
    assert "saving checkpoint 'step5'" in line and "File too large" in line and "still names 'step4'" in line
    assert sorted(p.name for p in ckpt.iterdir()) == before  # no .step5.partial, no train-meta-step5.json
    assert (ckpt / "latest").read_text() == "step4"
    assert main(["checkpoint", "verify", str(ckpt)]) == 0
