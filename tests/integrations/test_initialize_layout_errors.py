"""What ``polyaccel.initialize`` (and the trainers on it) say about a config's layout before anything changes:
an unknown top-level key lists every allowed key, the model layers' included; a tensor/expert layout asked for in
one process started without a launcher names the processes it needs and the torchrun command; a layout that
fits one process runs there as a world of one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)).double()


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_unknown_top_level_key_lists_the_layers_keys():
    import polyaccel
    from polyaccel import comm

    model = _model()
    before = _state(model)
    was_initialized = comm.is_initialized()
    cfg = {"tensor_paralel": {"autotp_size": 2}, "optimizer": {"type": "adamw", "params": {"lr": 1e-3}}}
    with pytest.raises(polyaccel.ConfigError) as info:
        polyaccel.initialize(model, cfg)
    msg = str(info.value)
    assert msg.startswith("unknown config key 'tensor_paralel'; allowed keys: "), msg
    listed, guess = msg.split("allowed keys: ", 1)[1].split("; did you mean ")
    assert guess == "'tensor_parallel'?", msg
    allowed = listed.split(", ")
    assert {"tensor_parallel", "expert_parallel", "zero_optimization", "optimizer"} <= set(allowed), allowed
    assert allowed == sorted(allowed)
    assert cfg == {"tensor_paralel": {"autotp_size": 2}, "optimizer": {"type": "adamw", "params": {"lr": 1e-3}}}
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert comm.is_initialized() == was_initialized  # refused before any process group


@pytest.mark.parametrize("layers,needed", [({"tensor_parallel": {"autotp_size": 2}}, 2),
                                           ({"tensor_parallel": {"autotp_size": 2},
                                             "expert_parallel": {"autoep_size": 2}}, 4)])
def test_multi_process_layout_in_one_process_names_the_torchrun_command(monkeypatch, layers, needed):
    import polyaccel
    from polyaccel import comm

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(comm, "is_initialized", lambda: False)  # as in a fresh process
    model = _model()
    before = _state(model)
    with pytest.raises(polyaccel.ConfigError) as info:
        polyaccel.initialize(model, layers)
    msg = str(info.value)
    assert f"needs {needed} processes" in msg and f"`torchrun --nproc-per-node {needed} " in msg, msg
    assert "'tensor_parallel.autotp_size'=2" in msg and "RANK" in msg
    assert ("'expert_parallel.autoep_size'=2" in msg) == ("expert_parallel" in layers)
    assert "environment variable" not in msg  # not torch's rendezvous error
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_trainer_data_axis_in_one_process_names_the_torchrun_command(monkeypatch):
    import polyaccel
    from polyaccel.integrations._engine import data_axis

    # the arithmetic for a world of ``world`` processes, whatever world an earlier test left this process in (the
    # layers also check their sizes against an initialised world)
    monkeypatch.setattr(polyaccel.comm, "is_initialized", lambda: False)

    assert data_axis({"tensor_parallel": {"autotp_size": 2}}, 3, 4) == (1, 2)
    assert data_axis({"tensor_parallel": {"autotp_size": 2}, "expert_parallel": {"autoep_size": 2}}, 2, 4) == (1, 2)
    assert data_axis({"zero_optimization": {"stage": 2}}, 1, 2) == (1, 2)
    with pytest.raises(polyaccel.ConfigError, match=r"needs a multiple of 4 processes.*this run has 1.*"
                                                    r"`torchrun --nproc-per-node 4 "):
        data_axis({"tensor_parallel": {"autotp_size": 2}, "expert_parallel": {"autoep_size": 2}}, 0, 1)
    with pytest.raises(polyaccel.ConfigError, match="this run has 6"):
        data_axis({"tensor_parallel": {"autotp_size": 4}}, 0, 6)


_ONE_PROCESS = """
import torch, polyaccel
from polyaccel.engines.autoep.models import build_tiny
model = build_tiny("qwen3_moe", torch.float64, vocab=64, hidden=32, experts=4, ffn=16, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8)
engine = polyaccel.initialize(model, {"tensor_parallel": {"autotp_size": 1}, "expert_parallel": {"autoep_size": 1},
                                      "optimizer": {"type": "adamw", "params": {"lr": 1e-3}}})
ids = torch.randint(0, 64, (2, 8))
engine.backward(engine(input_ids=ids, labels=ids).loss)
print("stepped", engine.step(), engine.mesh.size("data"), polyaccel.comm.get_world_size())
engine.destroy()
polyaccel.comm.destroy()
"""


def test_one_process_layout_runs_as_a_world_of_one():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", _ONE_PROCESS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stepped True 1 1" in out.stdout
