"""`polyaccel train` argument checks: clear errors before any rank is spawned."""


import pytest
from polyaccel.apps.train.options import TrainOptions, options_from_args, write_checkpoint_meta
from polyaccel.cli import main


def _fake_checkpoint(tmp_path, step=3, **model):
    spec = {"name": "llama", "vocab_size": 256, "hidden_size": 128, "num_layers": 2, "num_heads": 4,
            "max_positions": 256}
    spec.update(model)
    (tmp_path / "latest").write_text(f"step{step}")
    write_checkpoint_meta(str(tmp_path), f"step{step}", {"step": step, "model": spec})
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--batch-size", "-2"], "--batch-size -2"),
    (["--grad-accum", "0"], "--grad-accum 0"),
    (["--seq-len", "1"], "--seq-len 1"),
    (["--seq-len", "5000"], "--seq-len 5000: the text has only"),
    (["--lr", "-1"], "--lr -1.0: must be a positive finite number"),
    (["--lr", "nan"], "--lr nan"),
    (["--grad-clip", "-1"], "--grad-clip -1.0"),
    (["--heads", "3"], "--hidden-size 128 is not divisible by --heads 3"),
    (["--nproc", "0"], "--nproc 0"),
    (["--threads", "-1"], "--threads -1"),
    (["--save-every", "5"], "--save-every needs --save DIR"),
    (["--resume-tag", "step3"], "--resume-tag needs --resume DIR"),
    (["--text", "/nonexistent/t.txt"], "--text /nonexistent/t.txt: no such file"),
    (["--accelerator", "no-such-plugin"], "no-such-plugin"),
])
def test_bad_arguments_are_reported_before_spawning(no_spawn, capsys, argv, message):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polyaccel train: error: ")
    assert message in err


def test_argparse_choices_reject_unknown_values(no_spawn, capsys):
    for argv in (["--stage", "4"], ["--dtype", "int8"], ["--model", "bert"]):
        with pytest.raises(SystemExit) as exc:
            main(["train", *argv])
        assert exc.value.code == 2
        assert "invalid choice" in capsys.readouterr().err


def test_save_path_that_is_a_file(no_spawn, capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["train", "--save", str(f)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_resume_errors(no_spawn, capsys, tmp_path):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no 'latest' file" in capsys.readouterr().err

    (tmp_path / "latest").write_text("step9")
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "was not written by `polyaccel train --save`" in capsys.readouterr().err

    _fake_checkpoint(tmp_path, step=3, hidden_size=64)
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "hidden_size: saved 64, asked 128" in capsys.readouterr().err

    _fake_checkpoint(tmp_path, step=3)
    assert main(["train", "--resume", str(tmp_path), "--steps", "3"]) == 2
    assert "already at step 3; pass --steps greater than 3" in capsys.readouterr().err


def _args(argv):
    from polyaccel.cli import build_parser

    return build_parser().parse_args(["train", *argv])


def test_resume_reads_step_and_tag(tmp_path):
    import polyaccel

    _fake_checkpoint(tmp_path, step=3)
    opts = options_from_args(_args(["--resume", str(tmp_path), "--steps", "5"]), polyaccel.get_accelerator())
    assert (opts.start_step, opts.resume_tag) == (3, "step3")


def test_defaults_and_engine_config():
    import polyaccel

    acc = polyaccel.get_accelerator()
    opts = options_from_args(_args([]), acc)
    assert (opts.nproc, opts.stage, opts.dtype, opts.accelerator) == (2, 2, "fp32", acc.name)
    assert opts.threads >= 1
    cfg = opts.engine_config()
    assert cfg["zero_optimization"] == {"stage": 2}
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["optimizer"]["params"]["lr"] == opts.lr
    assert "bf16" not in cfg and "fp16" not in cfg

    o3 = options_from_args(_args(["--stage", "3", "--offload", "--dtype", "bf16", "--grad-accum", "2"]), acc)
    z = o3.engine_config()["zero_optimization"]
    assert z["offload_optimizer"] == {"device": "cpu"} and z["offload_param"] == {"device": "cpu"}
    assert o3.engine_config()["bf16"] == {"enabled": True}
    assert o3.engine_config()["gradient_accumulation_steps"] == 2
    assert o3.tokens_per_step == 2 * 8 * 64 * 2

    o2 = options_from_args(_args(["--stage", "2", "--offload"]), acc)
    assert "offload_param" not in o2.engine_config()["zero_optimization"]


def test_options_pickle_for_spawned_ranks():
    import pickle

    opts = TrainOptions()
    assert pickle.loads(pickle.dumps(opts)) == opts


def test_resume_with_empty_latest_or_damaged_metadata(no_spawn, capsys, tmp_path):
    (tmp_path / "latest").write_text("")
    assert main(["train", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'latest'} is empty; write the tag to load into it" in err and "''" not in err

    meta = _fake_checkpoint(tmp_path, step=3) / "train-meta-step3.json"
    meta.write_bytes(meta.read_bytes()[:-9])  # truncated
    assert main(["train", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(meta) in err and "checksum mismatch" in err and len(err.strip().splitlines()) == 1

    meta.write_text('{"step": 3, "model": {}}')  # written before checksums
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "has no checksum" in capsys.readouterr().err
