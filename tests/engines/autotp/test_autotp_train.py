"""``polyaccel train --tp N``: argument checks before any rank starts, and a 2-rank run at tensor 2."""

from __future__ import annotations

import json

import pytest
import torch
from polyaccel.apps.train.options import options_from_args
from polyaccel.cli import main

pytestmark = pytest.mark.timeout(240)

TINY = ["--hidden-size", "64", "--layers", "1", "--heads", "2", "--batch-size", "4", "--seq-len", "32",
        "--threads", "1", "--lr", "1e-2"]


def _args(argv):
    from polyaccel.cli import build_parser

    return build_parser().parse_args(["train", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--tp", "0"], "--tp 0: must be at least 1"),
    (["--tp", "3"], "--tp 3 does not divide the 2 ranks (ranks = data x tensor); use a --tp among [1, 2]"),
    (["--nproc", "4", "--tp", "4", "--heads", "3", "--hidden-size", "96", "--model", "gpt2"], None),
])
def test_tp_arguments_checked_before_spawning(no_spawn, capsys, argv, message):
    if message is None:  # valid: GPT-2 with 3 heads over 4 ranks leaves one rank without heads, and that is fine
        import polyaccel

        opts = options_from_args(_args(argv), polyaccel.get_accelerator())
        assert opts.tp == 4 and opts.data_parallel == 1
        assert opts.engine_config()["tensor_parallel"] == {"autotp_size": 4}
        return
    assert main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


def test_tp1_config_has_no_tensor_parallel_section():
    import polyaccel

    opts = options_from_args(_args(["--nproc", "4", "--tp", "2"]), polyaccel.get_accelerator())
    assert opts.data_parallel == 2 and opts.tokens_per_step == 2 * 8 * 64
    assert "tensor_parallel" not in options_from_args(_args([]), polyaccel.get_accelerator()).engine_config()


def test_train_tp2(capfd, tmp_path):
    out = tmp_path / "m.json"
    rc = main(["train", *TINY, "--nproc", "2", "--tp", "2", "--steps", "4", "--metrics-out", str(out)])
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    res = json.loads(out.read_text())
    assert res["tp"] == 2 and res["world_size"] == 2
    assert res["tp_plan"] == {"column": 5, "row": 2, "vocab": 2, "replicated": 3}
    assert "tensor parallel" in captured.out and "AutoTP: tensor 2 x data 1; plan: 5 column, 2 row" in captured.out
    assert res["tokens_per_step"] == 4 * 32
    # step 1's loss is the unsharded model's on the same batch (both ranks of the group read data rank 0's rows)
    from polyaccel.apps.train.data import ByteTokenizer, TokenSampler, load_text
    from polyaccel.apps.train.model import ModelSpec, build_model

    opts = options_from_args(_args([*TINY, "--nproc", "2", "--tp", "2", "--steps", "4"]), _acc())
    torch.manual_seed(opts.seed)
    model = build_model(ModelSpec(**res["model"]))
    sampler = TokenSampler(ByteTokenizer().encode(load_text(None)), opts.seq_len, opts.batch_size, opts.seed)
    b = sampler.batch(0, 0, 0, 1)
    with torch.no_grad():
        want = model(input_ids=b.input_ids, labels=b.labels).loss.item()
    assert res["losses"][0] == pytest.approx(want, rel=1e-5)
    assert res["losses"][-1] < res["losses"][0]


def _acc():
    import polyaccel

    return polyaccel.get_accelerator()
