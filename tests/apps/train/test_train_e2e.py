"""`polyaccel train` end to end: 2 ranks on the cpu plugin over gloo, launched through torchrun's API.

Tiny settings (a 1-layer, 64-wide model, short sequences) keep each launch to a few seconds of
training; most of the time is the two ranks starting up.
"""

import json

import polyaccel
import pytest
from polyaccel.cli import main

TINY = ["--hidden-size", "64", "--layers", "1", "--heads", "2", "--batch-size", "4", "--seq-len", "32",
        "--threads", "1", "--lr", "1e-2"]

pytestmark = pytest.mark.timeout(240)


def _run(capfd, tmp_path, name, *argv):
    out = tmp_path / f"{name}.json"
    rc = main(["train", *TINY, "--metrics-out", str(out), *argv])
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    return json.loads(out.read_text()), captured.out


def test_trains_saves_and_resumes_identically(capfd, tmp_path):
    ckpt = tmp_path / "ckpt"
    # the uninterrupted run: 8 steps, checkpoints at step 4 (mid-run) and step 8 (end)
    full, out = _run(capfd, tmp_path, "full", "--steps", "8", "--stage", "2", "--save", str(ckpt),
                     "--save-every", "4")
    losses = full["losses"]
    assert len(losses) == 8 and full["world_size"] == 2 and full["comm_backend"] == "gloo"
    assert losses[-1] < losses[0] - 0.5, losses  # it learns
    assert full["checkpoints"] == [str(ckpt / "step4"), str(ckpt / "step8")]
    assert (ckpt / "latest").read_text().strip() == "step8"
    # nothing half-written left behind
    assert not [p for p in ckpt.rglob("*") if "tmp" in p.name or p.name.startswith(".")]

    # the summary names the plugin, the comm backend and the optimizer's op builder, as the registry chose it
    builder = polyaccel.ops.registry.chosen("fused_adam", "cpu")
    assert full["plugin"] == polyaccel.get_accelerator().name == "cpu"
    assert full["op_builders"] == [{"op": "fused_adam", "builder": builder.name, "plugin": builder.plugin,
                                    "kind": builder.kind, "device_type": "cpu"}]
    for text in ("accelerator plugin", "cpu", "gloo", builder.name, "stage 2", "0 -> 8"):
        assert text in out, text
    assert "step 8/8" in out  # progress lines when the output is not a terminal

    # resume from the mid-run checkpoint: the same losses as the run that never stopped
    resumed, out = _run(capfd, tmp_path, "resumed", "--steps", "8", "--stage", "2", "--resume", str(ckpt),
                        "--resume-tag", "step4")
    assert resumed["start_step"] == 4
    assert resumed["losses"] == losses[4:]
    assert "resumed from" in out


def test_stage3_offload_bf16_gpt2_with_accumulation(capfd, tmp_path):
    res, out = _run(capfd, tmp_path, "s3", "--model", "gpt2", "--stage", "3", "--offload", "--dtype", "bf16",
                    "--grad-accum", "2", "--steps", "4")
    assert res["stage"] == 3 and res["offload"] and res["dtype"] == "bf16" and res["model"]["name"] == "gpt2"
    assert res["tokens_per_step"] == 2 * 4 * 32 * 2
    assert len(res["losses"]) == 4 and res["losses"][-1] < res["losses"][0]
    assert res["op_builders"][0]["device_type"] == "cpu"
    assert "optimizer + params -> cpu" in out


def test_a_failing_rank_is_reported_clearly(capfd, tmp_path):
    # metadata says a checkpoint exists, but the engine's files are missing: the ranks fail on load
    from polyaccel.apps.train.model import ModelSpec
    from polyaccel.apps.train.options import write_checkpoint_meta

    spec = ModelSpec(hidden_size=64, num_layers=1, num_heads=2)
    write_checkpoint_meta(str(tmp_path), "step2", {"step": 2, "model": spec.as_dict()})
    (tmp_path / "latest").write_text("step2")
    rc = main(["train", *TINY, "--steps", "4", "--resume", str(tmp_path)])
    err = capfd.readouterr().err
    assert rc == 2
    assert err.startswith("polyaccel train: error: rank ") and "failed" in err


def test_partial_offload_trains_like_the_whole_offload(capfd, tmp_path):
    """--offload-ratio 0.5 on 2 ranks: the device steps about half of each partition, the host the rest, and the
    losses are those of the fully offloaded run (the same fp32 AdamW arithmetic; only its placement differs)."""
    whole, _ = _run(capfd, tmp_path, "whole", "--model", "llama", "--stage", "2", "--offload", "--steps", "4")
    part, out = _run(capfd, tmp_path, "part", "--model", "llama", "--stage", "2", "--offload", "--offload-ratio",
                     "0.5", "--steps", "4")
    assert whole["host_optimizer_share"] == 1.0
    assert abs(part["host_optimizer_share"] - 0.5) < 0.1, part["host_optimizer_share"]
    assert part["losses"] == pytest.approx(whole["losses"], rel=1e-6)
    assert part["losses"][-1] < part["losses"][0]
    assert f"optimizer -> cpu ({part['host_optimizer_share']:.0%} of it;" in out  # (the table wraps the rest)


@pytest.mark.parametrize("argv, words", [
    (["--offload-ratio", "0.5"], "--offload-ratio 0.5 needs --offload"),
    (["--offload", "--offload-ratio", "0"], "--offload-ratio 0.0: must be in (0, 1]"),
    (["--offload", "--offload-ratio", "nan"], "--offload-ratio nan: must be in (0, 1]"),
    (["--offload", "--offload-ratio", "1.5"], "--offload-ratio 1.5: must be in (0, 1]"),
    (["--offload", "--offload-ratio", "0.5", "--stage", "3"], "needs --stage 1 or 2"),
    (["--offload", "--offload-ratio", "0.5", "--optimizer", "muon"], "needs --optimizer adamw"),
    (["--offload", "--offload-ratio", "0.5", "--tp", "2"], "needs --tp 1"),
])
def test_offload_ratio_refused_where_it_cannot_apply_before_spawning(no_spawn, capsys, argv, words):
    assert main(["train", *TINY, "--nproc", "2", *argv]) == 2
    assert words in capsys.readouterr().err


def test_offload_ratio_reaches_the_engine_config_with_buckets_to_split():
    from polyaccel.apps.train.options import PARTIAL_OFFLOAD_BUCKETS, options_from_args
    from polyaccel.cli import build_parser

    def opts(*argv):
        return options_from_args(build_parser().parse_args(["train", *TINY, "--nproc", "2", *argv]),
                                 polyaccel.get_accelerator())

    zero = opts("--offload", "--offload-ratio", "0.25").engine_config()["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "ratio": 0.25}
    n = sum(p.numel() for p in _model_of(opts().model).parameters())
    assert zero["reduce_bucket_size"] == n // PARTIAL_OFFLOAD_BUCKETS
    plain = opts("--offload").engine_config()["zero_optimization"]
    assert plain["offload_optimizer"] == {"device": "cpu"} and "reduce_bucket_size" not in plain


def _model_of(spec):
    from polyaccel.apps.train.model import build_model

    return build_model(spec)
