"""Nothing writes onto what it reads or onto a checkpoint it was not asked to create: reserved and invalid tags
are refused before anything moves (the previous checkpoint still loads), ``zero-to-fp32`` refuses an output
inside the checkpoint it converts (``latest``, a rank shard, the folder itself, a hard link to a shard), and
a failed save says truthfully what ``latest`` names."""

from __future__ import annotations

import argparse
import os

import polyaccel
import pytest
import torch
from polyaccel.cli import main
from polyaccel.engines.zero import checkpoint as ck
from polyaccel.engines.zero import cli_zero_to_fp32
from polyaccel.engines.zero.consolidate import consolidate
from polyaccel.errors import CheckpointError, InvalidArgument
from polyaccel.safe_files import dumps_checked, read_checked_json
from safetensors.torch import load_file

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    torch.manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    eng = polyaccel.initialize(net, {"optimizer": {"type": "adamw", "params": {"lr": 1e-2}},
                                     "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1})
    yield eng
    eng.destroy()


def _listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


@pytest.mark.parametrize("tag,words", [
    ("latest", "is reserved"), ("Latest", "is reserved"), ("a\0b", "NUL byte"), ("a/b", "path separator"),
    ("..", "starts with '.'"), ("", "is empty"), (" step1", "whitespace"), ("a\nb", "control character"),
    ("x" * 201, "longer than 200 bytes"), ("train-meta-step1.json", "ends with '.json'"),
])
def test_reserved_and_invalid_tags_are_refused_before_anything_moves(engine, tmp_path, tag, words):
    engine.save_checkpoint(tmp_path, tag="good")
    before = _listing(tmp_path)
    with pytest.raises(InvalidArgument, match=words):
        engine.save_checkpoint(tmp_path, tag=tag)
    assert _listing(tmp_path) == before
    assert (tmp_path / "latest").read_text() == "good"
    engine.load_checkpoint(tmp_path)  # the previous good checkpoint still loads
    if tag:
        with pytest.raises(InvalidArgument, match=words):
            engine.load_checkpoint(tmp_path, tag=tag)


def test_a_tag_naming_a_file_is_refused(engine, tmp_path):
    (tmp_path / "notes").write_text("mine")
    with pytest.raises(InvalidArgument, match="is a file, not a checkpoint folder"):
        engine.save_checkpoint(tmp_path, tag="notes")
    assert (tmp_path / "notes").read_text() == "mine" and not (tmp_path / "latest").exists()


def test_a_failed_save_says_what_latest_named(engine, tmp_path, monkeypatch):
    engine.save_checkpoint(tmp_path, tag="good")

    def crash(phase):
        if phase == "commit":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "_FAULT", crash)
    with pytest.raises(CheckpointError, match="'latest' still names 'good'"):
        engine.save_checkpoint(tmp_path, tag="next")
    (tmp_path / "latest").write_text("\n")  # unreadable before the save: said so, not "no checkpoint was there"
    with pytest.raises(CheckpointError, match="was already unreadable before this save"):
        engine.save_checkpoint(tmp_path, tag="next")
    monkeypatch.setattr(ck, "_FAULT", None)
    (tmp_path / "latest").write_text("good")
    engine.load_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "latest"]


def test_zero_to_fp32_never_writes_into_the_checkpoint_it_reads(engine, tmp_path, capsys):
    root = tmp_path / "ck"
    engine.save_checkpoint(root, tag="t1")
    shard = root / "t1" / "zero_rank_00000.safetensors"
    os.link(shard, tmp_path / "linked.safetensors")
    os.symlink(root / "t1", tmp_path / "alias")
    before = _listing(root)
    for out in (root / "latest", shard, root, root / "t1", root / "new.safetensors", tmp_path / "alias" / "x",
                tmp_path / "linked.safetensors"):
        args = argparse.Namespace(checkpoint_dir=str(root), output=str(out), tag=None, verify=True, progress=False)
        assert cli_zero_to_fp32.run(args) == 1, out
        err = capsys.readouterr().err
        assert "inside the checkpoint directory" in err or "under another name (a hard link)" in err, err
        assert _listing(root) == before
    assert main(["zero-to-fp32", str(root), str(tmp_path / "model.safetensors")]) == 0
    want = {k: v.float() for k, v in engine.full_state_dict().items()}
    got = load_file(str(tmp_path / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert consolidate(root).keys() == want.keys()


def test_a_command_s_unexpected_error_is_one_line_not_a_traceback(engine, tmp_path, capsys, monkeypatch):
    engine.save_checkpoint(tmp_path, tag="t1")
    meta_path = tmp_path / "t1" / "meta.json"
    meta, _ = read_checked_json(meta_path, "")
    del meta["world_size"]  # a record with a valid checksum but a key missing
    meta_path.write_text(dumps_checked(meta))
    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("polyaccel checkpoint: KeyError: 'world_size'") and "Traceback" not in err
    monkeypatch.setenv("POLYACCEL_TRACEBACK", "1")
    with pytest.raises(KeyError):
        main(["checkpoint", "verify", str(tmp_path)])
