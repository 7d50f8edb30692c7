"""Every optimizer setting a trainer hands over is carried into the engine or refused by name.

Hugging Face: a valid Muon config trains through ``PolyaccelTrainer`` (no AdamW ``betas`` injected, Newton-Schulz's
``eps`` not filled from ``adam_epsilon``), step for step as the engine driven by hand. Lightning: every setting of a
torch optimizer that changes the step (``maximize``, ``amsgrad``, ``capturable``, ``differentiable``, ``nesterov``,
an unknown key...) is refused naming it; ``foreach`` / ``fused`` (how torch would run the same step) are carried
as what they are: the engine's step is always one fused multi-tensor step.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from polyaccel.testing.multiprocess import run_ranks  # noqa: E402
from test_transformers import ENV, TokenData, _hand_driven, _recording, tiny_llama, training_args  # noqa: E402

MUON = {"type": "muon", "params": {"lr": "auto", "momentum": 0.9, "eps": 1e-6, "ns_steps": 3,
                                   "adam_lr": 3e-3, "adam_betas": [0.8, 0.9], "adam_eps": 1e-9}}


def test_engine_config_gives_muon_only_the_settings_it_has(tmp_path):
    from polyaccel.integrations.transformers import engine_config

    args = training_args(tmp_path, learning_rate=2e-2, weight_decay=0.05, adam_epsilon=1e-3, adam_beta2=0.5)
    cfg = engine_config(args, {"optimizer": MUON})
    assert cfg["optimizer"] == {"type": "muon", "params": {**MUON["params"], "lr": 2e-2, "weight_decay": 0.05}}
    assert MUON["params"]["lr"] == "auto"  # the caller's dict is only read
    adamw = engine_config(args, {})["optimizer"]["params"]
    assert adamw == {"lr": 2e-2, "betas": [0.9, 0.5], "eps": 1e-3, "weight_decay": 0.05}


def hf_muon_run(rank, world, out):
    from polyaccel.integrations.transformers import PolyaccelTrainer

    os.environ.update(ENV)
    args = training_args(out, max_steps=3, learning_rate=2e-2)
    trainer = _recording(PolyaccelTrainer)(model=tiny_llama(), args=args, train_dataset=TokenData(),
                                            polyaccel_config={"zero_optimization": {"stage": 2}, "optimizer": MUON})
    trainer.train()
    engine = trainer.polyaccel_engine
    full = {k: v.clone() for k, v in engine.full_state_dict().items()}
    muon = engine.config.optimizer
    engine.destroy()
    hand_losses, _, hand_state = _hand_driven(trainer.polyaccel_config, trainer.batches)
    start = tiny_llama().state_dict()
    return {"losses": trainer.losses, "hand_losses": hand_losses, "type": str(muon.type),
            "params": trainer.polyaccel_config["optimizer"]["params"],
            "diff": max((full[k] - hand_state[k]).abs().max().item() for k in full),
            "moved": max((full[k] - start[k]).abs().max().item() for k in full)}


def test_trainer_trains_with_a_muon_config(tmp_path):
    (r,) = run_ranks(hf_muon_run, 1, str(tmp_path / "out"), timeout=240, env=ENV)
    assert r["type"] == "muon" and "betas" not in r["params"] and r["params"]["eps"] == 1e-6
    assert len(r["losses"]) == 3 and r["diff"] == 0.0 and r["moved"] > 1e-3
    torch.testing.assert_close(r["losses"], r["hand_losses"], rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------- Lightning
def _lightning_config(opt):
    pytest.importorskip("lightning")
    from polyaccel.integrations.lightning import optimizer_config

    return optimizer_config(opt)


def _params():
    return [torch.nn.Parameter(torch.randn(3, 2))]


@pytest.mark.parametrize("make,setting", [
    (lambda p: torch.optim.AdamW(p, maximize=True), "maximize"),
    (lambda p: torch.optim.Adam(p, maximize=True), "maximize"),
    (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad"),
    (lambda p: torch.optim.AdamW(p, capturable=True), "capturable"),
    (lambda p: torch.optim.AdamW(p, differentiable=True), "differentiable"),
    (lambda p: torch.optim.SGD(p, lr=0.1, nesterov=True, momentum=0.9), "SGD"),
])
def test_lightning_refuses_a_setting_the_engine_would_drop(make, setting):
    from polyaccel.errors import ConfigError

    with pytest.raises(ConfigError, match=setting):
        _lightning_config(make(_params()))


def test_lightning_refuses_an_unknown_param_group_key_and_carries_the_rest():
    from polyaccel.errors import ConfigError

    opt = torch.optim.AdamW(_params(), lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, foreach=True)
    assert _lightning_config(opt) == {"type": "adamw", "params": {"lr": 0.01, "weight_decay": 0.1,
                                                                 "betas": [0.8, 0.9], "eps": 1e-6}}
    opt.param_groups[0]["centered"] = True  # a key the engine has no place for
    with pytest.raises(ConfigError, match="'centered'"):
        _lightning_config(opt)
    fused = torch.optim.Adam(_params(), lr=0.02, fused=True, weight_decay=0.01)
    assert _lightning_config(fused)["params"]["adam_w_mode"] is False


def test_lightning_refuses_an_optimizer_that_leaves_out_trainable_parameters():
    pytest.importorskip("lightning")
    from polyaccel.errors import ConfigError
    from polyaccel.integrations.lightning import optimizer_covers_module

    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    whole = torch.optim.AdamW(net.parameters())
    assert optimizer_covers_module(whole, net) is whole
    with pytest.raises(ConfigError, match=r"leaves out the trainable parameter\(s\) '0.weight', '0.bias'"):
        optimizer_covers_module(torch.optim.AdamW(net[1].parameters()), net)
    net[0].requires_grad_(False)  # frozen: the engine does not step them either
    optimizer_covers_module(torch.optim.AdamW(net[1].parameters()), net)
