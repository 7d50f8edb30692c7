"""The plan commands on a config.json transformers rejects: one line naming the file, exit status 2, no traceback
(and the same for an unknown family); a plan refusal stays exit status 1."""

from __future__ import annotations

import json

import pytest
from polyaccel.cli import main

BAD = {
    "not json": "not a valid JSON file",
    json.dumps({"model_type": "no_such_architecture_xyz"}): "no_such_architecture_xyz",
    json.dumps({"model_type": "llama", "hidden_size": "wide"}): "hidden_size",
    json.dumps({"model_type": "llama", "hidden_size": 16, "num_attention_heads": 0}): "ZeroDivisionError",
    json.dumps([1, 2]): "config.json",
}


@pytest.mark.parametrize("command", ["autotp-plan", "autoep-plan"])
def test_a_config_json_transformers_rejects_is_one_line_and_exit_2(command, tmp_path, capsys):
    for i, (text, words) in enumerate(BAD.items()):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(text)
        for arg in (str(d), str(d / "config.json"))[:1 if i else 2]:  # a directory, or the file itself
            assert main([command, "--model", arg]) == 2, (text, capsys.readouterr())
            err = capsys.readouterr().err
            assert err.startswith(f"polyaccel {command}: --model ") and str(d / "config.json") in err, err
            assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert main([command, "--model", str(tmp_path / "missing")]) == 2
    assert "choose one of" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([command, "--model", str(empty)]) == 2
    assert f"{empty / 'config.json'} does not exist" in capsys.readouterr().err
