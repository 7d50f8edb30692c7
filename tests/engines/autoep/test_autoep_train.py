"""`polyaccel train --model mixtral --ep N`: 2 gloo ranks, experts over both (AutoEP), ZeRO over data."""

from __future__ import annotations

import json

import polyaccel
import pytest
from polyaccel.cli import main

TINY = ["--model", "mixtral", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--batch-size", "2",
        "--seq-len", "16", "--threads", "1", "--lr", "1e-2"]

pytestmark = pytest.mark.timeout(240)


def test_train_mixtral_ep2(capfd, tmp_path):
    out = tmp_path / "m.json"
    rc = main(["train", *TINY, "--nproc", "2", "--ep", "2", "--steps", "4", "--metrics-out", str(out)])
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    res = json.loads(out.read_text())
    builder = polyaccel.ops.registry.chosen("grouped_mm", "cpu")
    assert res["ep"] == 2 and res["world_size"] == 2 and len(res["losses"]) == 4
    assert res["ep_plan"] == {"ep": 2, "expert_data": 1, "moe_layers": 1, "experts": 8,
                              "routing": "softmax top-2, post, renorm",
                              "grouped_mm": {"builder": builder.name, "plugin": builder.plugin, "kind": builder.kind,
                                             "device_type": "cpu"}}
    assert res["losses"][-1] < res["losses"][0]
    text = " ".join(captured.out.replace("│", " ").split())  # the summary table wraps long cells
    for words in ("AutoEP: expert 2 x expert_data 1", "8 experts (4 per rank)", f"grouped_mm: {builder.name}"):
        assert words in text, words


@pytest.mark.parametrize("argv, words", [
    (["--model", "mixtral", "--nproc", "2", "--ep", "3"], "--ep 3 does not divide the 2 data-parallel ranks"),
    (["--model", "llama", "--nproc", "2", "--ep", "2"], "--ep 2: model 'llama' has no experts"),
    (["--model", "mixtral", "--nproc", "4", "--ep", "4", "--tp", "2"],
     "--ep 4 does not divide the 2 data-parallel ranks (4 ranks / --tp 2"),
    (["--model", "mixtral", "--nproc", "8", "--ep", "16"], "--ep 16 does not divide the 8 data-parallel ranks"),
    (["--model", "mixtral", "--nproc", "16", "--ep", "16"], "does not divide the 8 experts"),
    (["--model", "mixtral", "--nproc", "2", "--ep", "0"], "--ep 0: must be at least 1"),
])
def test_bad_ep_is_refused_before_spawning(capfd, argv, words):
    assert main(["train", *argv]) != 0
    assert words in capfd.readouterr().err
