"""The records of one save are compared, and one writer at a time saves into a directory.

- ``meta.json`` carries the engine's run id; a ``<name>-<tag>.json`` beside the tag from another run (another run
  id, or, for records without one, other values than the client state the save kept) fails ``checkpoint verify``
  and the train app's resume check, naming both files;
- a save into a directory another process is saving into is refused before it writes, naming the holder.
"""

from __future__ import annotations

import os

import polyaccel
import pytest
import torch
from polyaccel.apps.train.run_records import check_records_agree
from polyaccel.cli import main
from polyaccel.dir_lock import DirectoryLock
from polyaccel.engines.zero.checkpoint import SAVE_LOCK, run_id
from polyaccel.errors import CheckpointError, ConfigError
from polyaccel.safe_files import dumps_checked, read_checked_json

pytestmark = pytest.mark.timeout(120)


def _engine(seed):
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    return polyaccel.initialize(net, {"optimizer": {"type": "adamw", "params": {"lr": 1e-2}},
                                      "zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 1})


def _listing(root):
    return sorted((str(p.relative_to(root)), p.read_bytes()) for p in root.rglob("*") if p.is_file())


def test_a_second_writer_is_refused_before_it_writes(tmp_path):
    eng = _engine(0)
    eng.save_checkpoint(tmp_path, tag="t1")
    before = _listing(tmp_path)
    with DirectoryLock(tmp_path, SAVE_LOCK, "a save of checkpoint 't9'"):
        holder = rf"is being written by a save of checkpoint 't9' \(pid {os.getpid()}"
        with pytest.raises(CheckpointError, match=holder):
            eng.save_checkpoint(tmp_path, tag="t2")
        assert [x for x in _listing(tmp_path) if x[0] != SAVE_LOCK] == before
    eng.save_checkpoint(tmp_path, tag="t2")  # the lock went with its holder
    assert (tmp_path / "latest").read_text() == "t2" and not (tmp_path / SAVE_LOCK).exists()
    eng.destroy()


def test_records_of_two_runs_are_not_taken_for_one_save(tmp_path, capsys):
    a, b = _engine(1), _engine(2)
    record = {"step": 3, "seed": 1}
    a.save_checkpoint(tmp_path / "a", tag="step3", client_state={"train": {**record, "run_id": run_id(a)}})
    b.save_checkpoint(tmp_path / "b", tag="step3", client_state={"train": {**record, "seed": 2, "run_id": run_id(b)}})
    assert run_id(a) != run_id(b)
    side = tmp_path / "a" / "train-meta-step3.json"
    side.write_text(dumps_checked({**record, "run_id": run_id(a)}))
    assert main(["checkpoint", "verify", str(tmp_path / "a")]) == 0
    check_records_agree(str(tmp_path / "a"), "step3", {**record, "run_id": run_id(a)})
    capsys.readouterr()

    other = {**record, "seed": 2, "run_id": run_id(b)}  # b's record beside a's folder
    side.write_text(dumps_checked(other))
    assert main(["checkpoint", "verify", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert f"{side} (run {run_id(b)})" in err and "do not belong to one save" in err
    with pytest.raises(ConfigError, match="seed: 2 in the metadata file, 1 in the checkpoint"):
        check_records_agree(str(tmp_path / "a"), "step3", other)

    # records saved without a run id (an older save): their values are compared with the client state kept
    meta_path = tmp_path / "a" / "step3" / "meta.json"
    meta, _ = read_checked_json(meta_path, "")
    meta.pop("run_id")
    meta["client_state"] = {"train": record}
    meta_path.write_text(dumps_checked(meta))
    side.write_text(dumps_checked(record))
    assert main(["checkpoint", "verify", str(tmp_path / "a")]) == 0
    side.write_text(dumps_checked({**record, "seed": 2}))
    assert main(["checkpoint", "verify", str(tmp_path / "a")]) == 1
    assert "seed: 2 there, 1 in the checkpoint" in capsys.readouterr().err
    a.destroy()
    b.destroy()


def test_init_from_refuses_a_state_dict_of_integers_for_the_model_s_floats(tmp_path):
    from polyaccel.apps.train.model import ModelSpec, build_model
    from polyaccel.apps.train.options import resolve_init_from
    from safetensors.torch import save_file

    spec = ModelSpec(hidden_size=32, num_layers=1, num_heads=2).validate()
    state = {k: v.contiguous() for k, v in build_model(spec).state_dict().items()}
    save_file(state, str(tmp_path / "good.safetensors"))
    assert resolve_init_from(str(tmp_path / "good.safetensors"), spec) == tmp_path / "good.safetensors"
    name = next(iter(state))
    save_file({**state, name: state[name].to(torch.int32)}, str(tmp_path / "ints.safetensors"))
    with pytest.raises(ConfigError, match=rf"dtype: {name} I32 \(the model's is floating\)"):
        resolve_init_from(str(tmp_path / "ints.safetensors"), spec)
