"""`polyaccel train --sp S`: bad layouts refused before any rank starts (naming the numbers and the sizes that
fit), and `--sp 2 --nproc 2` on the cpu plugin trains exactly what one process trains on the whole sequences:
each step's loss (the whole sequence's, the sum of the two ranks' shares) equals plain torch AdamW with clipping
on the same rows, and tokens/s counts every token once; its checkpoint resumes in one process without --sp."""

from __future__ import annotations

import json

import polyaccel
import pytest
import torch
from polyaccel.apps.train.options import options_from_args
from polyaccel.cli import build_parser, main

pytestmark = pytest.mark.timeout(240)

TINY = ["--hidden-size", "32", "--layers", "1", "--heads", "4", "--batch-size", "3", "--seq-len", "16",
        "--threads", "1", "--lr", "1e-2"]


def _opts(argv):
    return options_from_args(build_parser().parse_args(["train", *argv]), polyaccel.get_accelerator())


def test_sp_config_data_size_and_help(capsys):
    opts = _opts([*TINY, "--nproc", "8", "--tp", "2", "--sp", "2"])
    assert opts.data_parallel == 2 and opts.tokens_per_step == 2 * 3 * 16
    assert opts.engine_config()["sequence_parallel"] == {"autosp_size": 2, "seq_dim": 1}
    assert "sequence_parallel" not in _opts([*TINY, "--nproc", "2"]).engine_config()
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--sp S sequence-parallel degree (AutoSP, Ulysses attention)" in out
    assert "polyaccel train --sp 2 --nproc 2" in out


@pytest.mark.parametrize("argv, words", [
    (["--nproc", "6", "--sp", "4"], "--sp 4 does not divide the 6 ranks (ranks = data x sequence x tensor); use an "
                                    "--sp among [1, 2, 3, 6]"),
    (["--nproc", "8", "--tp", "2", "--sp", "3"], "--sp 3 does not divide the 8 ranks / --tp 2 = 4"),
    (["--nproc", "6", "--sp", "3", "--seq-len", "16"], "--sp 3 does not divide --seq-len 16 (16 % 3 = 1: each "
                                                       "sequence rank holds seq_len / sp tokens); use an --sp among "
                                                       "[1, 2]"),
    (["--nproc", "8", "--sp", "8", "--heads", "4"], "--sp 8 does not divide the attention heads of a tensor rank "
                                                    "(--heads 4; Ulysses attention gives each sequence rank whole "
                                                    "heads); use an --sp among [1, 2, 4]"),
    (["--nproc", "8", "--tp", "2", "--sp", "4"], "--sp 4 does not divide the attention heads of a tensor rank "
                                                 "(--heads 4 / --tp 2 = 2;"),
    (["--nproc", "8", "--sp", "2", "--model", "mixtral", "--ep", "8"],
     "--ep 8 does not divide the 4 data-parallel ranks (8 ranks / --sp 2;"),
    (["--nproc", "2", "--sp", "0"], "--sp 0: must be at least 1"),
])
def test_bad_sp_layouts_refused_before_spawning(no_spawn, capsys, argv, words):
    assert main(["train", *TINY, *argv]) == 2
    assert words in capsys.readouterr().err


def _reference_losses(opts) -> list[float]:
    """Plain torch on one process: the seeded model, AdamW with the run's settings and clipping, the rows the one
    data rank draws, the loss of the whole sequences."""
    from polyaccel.apps.train.data import ByteTokenizer, TokenSampler, load_text
    from polyaccel.apps.train.model import build_model

    torch.manual_seed(opts.seed)
    model = build_model(opts.model)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sampler = TokenSampler(ByteTokenizer().encode(load_text(None)), opts.seq_len, opts.batch_size, opts.seed)
    losses = []
    for step in range(opts.steps):
        b = sampler.batch(step, 0, 0, 1)
        loss = model(input_ids=b.input_ids, labels=b.labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_train_sp2_equals_one_process_on_the_whole_sequence(capfd, tmp_path):
    out = tmp_path / "m.json"
    ckpt = tmp_path / "ckpt"
    argv = [*TINY, "--nproc", "2", "--sp", "2", "--steps", "3", "--stage", "3", "--metrics-out", str(out)]
    rc = main(["train", *argv, "--save", str(ckpt), "--save-every", "2"])
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    res = json.loads(out.read_text())
    assert res["sp"] == 2 and res["world_size"] == 2
    assert res["tokens_per_step"] == 1 * 3 * 16  # one data rank: each token counted once, not once per rank
    text = " ".join(captured.out.replace("│", " ").split())
    assert "sequence parallel 2 x data 1" in text
    assert "AutoSP (Ulysses attention): sequence 2 x data 1; 8 of 16 tokens per rank; sequence 2, Ulysses over 1 " \
           "attention modules (sdpa); 4 query heads -> 2 per rank" in text
    want = _reference_losses(_opts(argv))
    assert res["losses"] == pytest.approx(want, rel=2e-5, abs=0), (res["losses"], want)
    assert res["losses"][-1] < res["losses"][0]

    # the checkpoint of step 2 holds no sequence layout: one process without --sp continues it
    resumed = tmp_path / "r.json"
    rc = main(["train", *TINY, "--nproc", "1", "--steps", "3", "--stage", "2", "--resume", str(ckpt), "--resume-tag",
               "step2", "--metrics-out", str(resumed)])
    assert rc == 0, capfd.readouterr().err
    assert json.loads(resumed.read_text())["losses"] == pytest.approx(want[2:], rel=2e-5, abs=0)
