"""`polyaccel train --tp T --ep E` and `--init-from`: bad combinations refused before any rank starts (naming the
constraint), and one 4-rank run at tensor 2 x expert 2 that starts from a plain Hugging Face safetensors state
dict, saves, and consolidates with `zero-to-fp32` into the state dict a plain Hugging Face Mixtral loads."""

from __future__ import annotations

import json

import polyaccel
import pytest
import torch
from polyaccel.apps.train.options import options_from_args
from polyaccel.cli import build_parser, main

pytestmark = pytest.mark.timeout(240)

TINY = ["--model", "mixtral", "--hidden-size", "32", "--layers", "1", "--heads", "4", "--batch-size", "2",
        "--seq-len", "16", "--threads", "1", "--lr", "1e-2"]


def _opts(argv):
    return options_from_args(build_parser().parse_args(["train", *argv]), polyaccel.get_accelerator())


def _init_file(tmp_path, seed: int = 99, **changes) -> str:
    from polyaccel.apps.train.model import build_model
    from safetensors.torch import save_file

    spec = _opts(TINY).model
    if changes:
        from dataclasses import replace

        spec = replace(spec, **changes)
    torch.manual_seed(seed)
    path = tmp_path / f"init-{seed}-{len(changes)}.safetensors"
    save_file({k: v.contiguous() for k, v in build_model(spec).state_dict().items()}, str(path))
    return str(path)


def test_tp_with_ep_config_and_data_size():
    opts = _opts([*TINY, "--nproc", "8", "--tp", "2", "--ep", "2"])
    cfg = opts.engine_config()
    assert opts.data_parallel == 4
    assert cfg["tensor_parallel"] == {"autotp_size": 2} and cfg["expert_parallel"] == {"autoep_size": 2}


@pytest.mark.parametrize("argv, words", [
    (["--nproc", "8", "--tp", "3", "--ep", "2"], "--tp 3 does not divide the 8 ranks (ranks = data x tensor)"),
    (["--nproc", "8", "--tp", "2", "--ep", "3"],
     "--ep 3 does not divide the 4 data-parallel ranks (8 ranks / --tp 2; experts are spread over ep ranks carved "
     "out of data); use an --ep among [1, 2, 4]"),
    (["--nproc", "8", "--tp", "4", "--ep", "4"], "--ep 4 does not divide the 2 data-parallel ranks"),
    (["--nproc", "16", "--tp", "1", "--ep", "16"], "does not divide the 8 experts"),
    (["--nproc", "4", "--tp", "2", "--ep", "2", "--model", "llama"], "--ep 2: model 'llama' has no experts"),
])
def test_bad_tp_ep_combinations_refused_before_spawning(no_spawn, capsys, argv, words):
    assert main(["train", *TINY, *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--nproc", "2", "--ep", "2"], "--capture-graphs needs --ep 1 (got 2)"),
    (["--nproc", "1", "--stage", "3"], "--capture-graphs needs --stage 1 or 2"),
    (["--nproc", "1", "--model", "llama"], "--capture-graphs replays the experts of a MoE layer; model 'llama'"),
    (["--nproc", "1"], "--capture-graphs: accelerator 'cpu' has no device graphs"),
])
def test_capture_graphs_refused_where_it_cannot_serve_before_spawning(no_spawn, capsys, argv, words):
    assert main(["train", *TINY, "--capture-graphs", *argv]) == 2
    assert words in capsys.readouterr().err
    assert main(["train", *TINY, "--capture-graphs", "true", *argv]) == 2  # the flag alone is "true"
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("value", ["auto", "false"])
def test_capture_graphs_auto_and_false_are_never_refused(value):
    """auto (the default) runs eagerly where graphs cannot serve: ep 2, stage 3, no graphs on the cpu."""
    for argv in (["--nproc", "2", "--ep", "2"], ["--nproc", "1", "--stage", "3"], ["--nproc", "1"]):
        cfg = _opts([*TINY, "--capture-graphs", value, *argv]).engine_config()
        assert cfg["expert_parallel"].get("capture_graphs", "auto") == {"auto": "auto", "false": False}[value]


def test_capture_graphs_reaches_the_expert_parallel_section(monkeypatch):
    acc = polyaccel.get_accelerator()
    monkeypatch.setattr(type(acc), "has", lambda self, cap: cap == "graphs" or cap in self.capabilities())
    cfg = _opts([*TINY, "--nproc", "1", "--capture-graphs"]).engine_config()
    assert cfg["expert_parallel"] == {"autoep_size": 1, "capture_graphs": True}
    assert cfg == _opts([*TINY, "--nproc", "1", "--capture-graphs", "true"]).engine_config()
    assert "capture_graphs" not in _opts([*TINY, "--nproc", "1"]).engine_config()["expert_parallel"]  # auto


def test_init_from_checked_before_spawning(no_spawn, capsys, tmp_path):
    good = _init_file(tmp_path)
    assert _opts([*TINY, "--nproc", "4", "--tp", "2", "--ep", "2", "--init-from", good]).init_from == good
    saved = tmp_path / "saved"  # a directory Hugging Face saved into: its model.safetensors
    saved.mkdir()
    (saved / "model.safetensors").write_bytes(open(good, "rb").read())
    assert _opts([*TINY, "--init-from", str(saved)]).init_from == str(saved / "model.safetensors")
    other = _init_file(tmp_path, hidden_size=64)
    for argv, words in (
        (["--init-from", str(tmp_path / "none.safetensors")], "no such file"),
        (["--init-from", other], "does not fit the mixtral model of --hidden-size 32 --layers 1 --heads 4 (shape: "),
        (["--init-from", good, "--resume", str(tmp_path)], "a resumed run takes its weights from the checkpoint"),
    ):
        assert main(["train", *TINY, *argv]) == 2
        assert words in capsys.readouterr().err, argv


def test_train_tp2_ep2_from_a_hf_state_dict_then_zero_to_fp32(capfd, tmp_path):
    from polyaccel.apps.train.data import ByteTokenizer, TokenSampler, load_text
    from polyaccel.apps.train.model import build_model, hf_config
    from safetensors.torch import load_file
    from transformers import MixtralForCausalLM

    init = _init_file(tmp_path)
    out, ckpt = tmp_path / "m.json", tmp_path / "ckpt"
    argv = [*TINY, "--nproc", "4", "--tp", "2", "--ep", "2", "--steps", "2", "--init-from", init, "--save", str(ckpt),
            "--metrics-out", str(out)]
    rc = main(["train", *argv])
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    res = json.loads(out.read_text())
    assert res["tp"] == 2 and res["ep"] == 2 and res["world_size"] == 4 and res["init_from"] == init
    assert res["ep_plan"]["ep"] == 2 and res["ep_plan"]["expert_data"] == 1
    assert res["tp_plan"]["column"] > 0 and res["tp_plan"]["vocab"] == 2
    text = " ".join(captured.out.replace("│", " ").split())
    assert "AutoTP: tensor 2 x data 2" in text and "AutoEP: expert 2 x expert_data 1" in text
    # step 1's loss is the loss of the state dict's weights (not the seed's) on the two data ranks' rows
    opts = _opts(argv)
    model = build_model(opts.model)
    model.load_state_dict(load_file(init))
    sampler = TokenSampler(ByteTokenizer().encode(load_text(None)), opts.seq_len, opts.batch_size, opts.seed)
    with torch.no_grad():
        want = sum(model(input_ids=b.input_ids, labels=b.labels).loss.item()
                   for b in (sampler.batch(0, 0, d, 2) for d in range(2))) / 2
    assert res["losses"][0] == pytest.approx(want, rel=1e-5)
    # the checkpoint of the tensor x expert layout consolidates to the plain HF state dict
    full = tmp_path / "full.safetensors"
    assert main(["zero-to-fp32", str(ckpt), str(full)]) == 0, capfd.readouterr().err
    plain = MixtralForCausalLM(hf_config(opts.model))
    plain.load_state_dict(load_file(str(full)), strict=True)
    assert plain.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8
