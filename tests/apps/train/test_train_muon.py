"""`polyaccel train --optimizer muon`: the options it makes, and a short run on 2 gloo ranks."""

import json

import pytest
from polyaccel.cli import main

TINY = ["--hidden-size", "64", "--layers", "1", "--heads", "2", "--batch-size", "4", "--seq-len", "32",
        "--threads", "1"]

pytestmark = pytest.mark.timeout(240)


def _options(argv):
    import argparse

    import polyaccel
    from polyaccel.apps.train.command import add_arguments
    from polyaccel.apps.train.options import options_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return options_from_args(parser.parse_args(argv), polyaccel.get_accelerator())


def test_muon_options_and_engine_config():
    opts = _options(["--optimizer", "muon", "--weight-decay", "0.1"])
    assert (opts.optimizer, opts.lr, opts.adam_lr) == ("muon", 0.02, 3e-3)
    opt = opts.engine_config()["optimizer"]
    assert opt["type"] == "muon"
    assert opt["params"]["lr"] == 0.02 and opt["params"]["adam_lr"] == 3e-3
    assert opt["params"]["weight_decay"] == opt["params"]["adam_weight_decay"] == 0.1
    assert _options([]).lr == 3e-3 and _options([]).engine_config()["optimizer"]["type"] == "AdamW"
    assert _options(["--optimizer", "muon", "--lr", "0.05", "--adam-lr", "1e-3"]).adam_lr == 1e-3


def test_adam_lr_needs_muon(no_spawn, capsys):
    assert main(["train", "--adam-lr", "1e-3"]) == 2
    assert "--adam-lr" in capsys.readouterr().err
    assert main(["train", "--optimizer", "muon", "--adam-lr", "-1"]) == 2
    assert "--adam-lr -1" in capsys.readouterr().err


def test_train_with_muon_stage_3_runs_and_learns(capfd, tmp_path):
    out = tmp_path / "m.json"
    rc = main(["train", *TINY, "--optimizer", "muon", "--stage", "3", "--steps", "6", "--metrics-out", str(out)])
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    res = json.loads(out.read_text())
    assert res["optimizer"] == "muon" and res["muon_matrices"] == 7  # q, k, v, o, gate, up, down of the one layer
    assert len(res["losses"]) == 6 and res["losses"][-1] < res["losses"][0] - 0.3, res["losses"]
    assert "muon (" in captured.out
