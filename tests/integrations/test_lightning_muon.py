"""PolyaccelStrategy takes ``torch.optim.Muon`` over the hidden matrices with an AdamW for the rest from
``configure_optimizers`` (Lightning's manual optimization, the only way Lightning runs two optimizers): the pair
becomes the engine's ``optimizer.type: "muon"`` section with every setting under its engine name, and training equals
the same engine driven by hand with that section, and torch's own Muon and AdamW (float64, schedules on both).
What the engine could not step exactly as the two torch optimizers is refused naming it."""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("lightning")

from polyaccel.errors import ConfigError  # noqa: E402
from polyaccel.testing.multiprocess import run_ranks  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1"}
MUON_LR, ADAM_LR = 5e-2, 1e-2
MUON_KW = {"weight_decay": 0.1, "momentum": 0.9, "nesterov": False, "ns_steps": 4, "eps": 1e-6,
           "ns_coefficients": (3.0, -3.2, 1.2), "adjust_lr_fn": "match_rms_adamw"}
ADAM_KW = {"betas": (0.8, 0.95), "eps": 1e-7, "weight_decay": 0.01}
EXPECTED = {"type": "muon", "params": {
    "lr": MUON_LR, "weight_decay": 0.1, "momentum": 0.9, "nesterov": False, "ns_steps": 4,
    "ns_coefficients": [3.0, -3.2, 1.2], "eps": 1e-6, "lr_adjustment": "match_rms_adamw", "ns_dtype": "bf16",
    "muon_params": ["net.0.weight", "net.3.weight"],
    "adam_params": ["net.0.bias", "net.1.weight", "net.1.bias", "net.3.bias", "net.5.weight", "net.5.bias"],
    "adam_lr": ADAM_LR, "adam_betas": [0.8, 0.95], "adam_eps": 1e-7, "adam_weight_decay": 0.01}}


def _net():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(), torch.nn.Linear(8, 6),
                              torch.nn.Tanh(), torch.nn.Linear(6, 2))
    with torch.no_grad():  # the norm starts at ones and zeros: move it so a wrong Adam step shows at once
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return net.double()


def _split(net):
    """Muon: the hidden matrices (net.0, net.3); AdamW: biases, the norm and the output layer (net.5)."""
    hidden = {"0.weight", "3.weight"}
    return ([p for n, p in net.named_parameters() if n in hidden],
            [p for n, p in net.named_parameters() if n not in hidden])


def _loss(net, batch):
    return net(batch).sin().square().mean()


def make_module(adam_gamma=0.5, muon_steps=1):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False  # Lightning runs several optimizers in manual optimization only
            self.net = _net()
            self.batches, self.losses = [], []

        def training_step(self, batch, batch_idx):
            muon, adam = self.optimizers()
            self.batches.append(batch.clone())
            loss = _loss(self.net, batch)
            self.manual_backward(loss)
            for _ in range(muon_steps):
                muon.step()
            adam.step()
            for sched in self.lr_schedulers():
                sched.step()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            hidden, rest = _split(self.net)
            muon = torch.optim.Muon(hidden, lr=MUON_LR, **MUON_KW)
            adam = torch.optim.AdamW(rest, lr=ADAM_LR, **ADAM_KW)
            scheds = [torch.optim.lr_scheduler.StepLR(muon, step_size=2, gamma=0.5),
                      torch.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=adam_gamma)]
            return [muon, adam], scheds

    return Module()


class _Holder(torch.nn.Module):
    """The same parameter names as the LightningModule (``net.*``), the same loss."""

    def __init__(self):
        super().__init__()
        self.net = _net()

    def forward(self, batch):
        return _loss(self.net, batch)


def _fit(module, out):
    import lightning.pytorch as pl
    from polyaccel.integrations.lightning import PolyaccelStrategy

    data = torch.randn(24, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    trainer = pl.Trainer(accelerator="polyaccel", devices=1, strategy=PolyaccelStrategy(stage=2),
                         precision="64-true", max_epochs=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         default_root_dir=out)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    return trainer


def lightning_muon(rank, world, out):
    import polyaccel

    os.environ.update(ENV)
    torch.set_num_threads(1)
    module = make_module()
    trainer = _fit(module, out)
    cfg = copy.deepcopy(trainer.strategy.polyaccel_config)
    engine = trainer.strategy.polyaccel_engine
    full = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.destroy()

    # the same engine, driven by hand with the section written out, on the batches Lightning fed
    hand_cfg = {**cfg, "optimizer": copy.deepcopy(EXPECTED)}
    ref = polyaccel.initialize(_Holder(), config=hand_cfg)
    hand_losses = []
    for i, batch in enumerate(module.batches):
        ref.set_lr(MUON_LR * 0.5 ** (i // 2))
        loss = ref(batch)
        ref.backward(loss)
        ref.step()
        hand_losses.append(loss.item())
    hand = {k: v.clone() for k, v in ref.full_state_dict().items()}
    ref.destroy()

    # and torch's own Muon and AdamW (Newton-Schulz in bf16 in both) with the same schedules
    net = _net()
    hidden, rest = _split(net)
    muon, adam = torch.optim.Muon(hidden, lr=MUON_LR, **MUON_KW), torch.optim.AdamW(rest, lr=ADAM_LR, **ADAM_KW)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (muon, adam)]
    for batch in module.batches:
        _loss(net, batch).backward()
        for o in (muon, adam):
            o.step()
            o.zero_grad()
        for sched in scheds:
            sched.step()
    start = dict(_Holder().named_parameters())
    res = {"section": cfg["optimizer"], "losses": module.losses, "hand_losses": hand_losses,
           "diff": max((full[k] - hand[k]).abs().max().item() for k in hand),
           "torch_diff": max((full[f"net.{n}"] - p.detach()).abs().max().item() for n, p in net.named_parameters()),
           "moved": {k: (full[k] - start[k].detach()).abs().max().item() for k in hand}}
    for name, kw in (("gamma", {"adam_gamma": 0.3}), ("twice", {"muon_steps": 2})):
        try:
            _fit(make_module(**kw), out)
            res[name] = "trained"
        except ConfigError as exc:
            res[name] = str(exc)
    return res


def test_lightning_muon_with_adamw_trains_as_the_engine_with_its_muon_section(tmp_path):
    (r,) = run_ranks(lightning_muon, 1, str(tmp_path), timeout=180, env=ENV)
    assert r["section"] == EXPECTED
    assert len(r["losses"]) == 6
    assert r["losses"] == r["hand_losses"] and r["diff"] == 0.0, r["diff"]
    assert r["torch_diff"] < 1e-12, r["torch_diff"]
    assert min(r["moved"].values()) > 1e-3, r["moved"]  # every parameter, Muon's and AdamW's, was stepped
    assert "AdamW's lr is" in r["gamma"] and "schedule both optimizers by the same factor" in r["gamma"]
    assert "Muon stepped twice before AdamW" in r["twice"]


# ---------------------------------------------------------------------------------------------- refusals
def _pair(muon_kw=None, adam_cls=torch.optim.AdamW, adam_kw=None):
    net = _net()
    hidden, rest = _split(net)
    return net, torch.optim.Muon(hidden, lr=MUON_LR, **(muon_kw or {})), adam_cls(rest, lr=ADAM_LR, **(adam_kw or {}))


def _config(muon, adam, net):
    from polyaccel.integrations.lightning import muon_optimizer_config

    return muon_optimizer_config(muon, adam, net)


def test_muon_pair_maps_every_setting_and_per_group_weight_decays():
    net, muon, adam = _pair(MUON_KW, adam_kw=ADAM_KW)
    section, groups = _config(muon, adam, net)
    assert section == {**EXPECTED, "params": {**EXPECTED["params"], "muon_params": ["0.weight", "3.weight"],
                                              "adam_params": [n[4:] for n in EXPECTED["params"]["adam_params"]]}}
    assert groups == []
    section, _ = _config(torch.optim.Muon(_split(net)[0], adjust_lr_fn=None), adam, net)
    assert section["params"]["lr_adjustment"] == "original" and section["params"]["nesterov"] is True
    hidden, rest = _split(net)
    adam = torch.optim.AdamW([{"params": rest[:1]}, {"params": rest[1:], "weight_decay": 0.0}], lr=ADAM_LR,
                             weight_decay=0.2)
    section, groups = _config(torch.optim.Muon(hidden, weight_decay=0.05), adam, net)
    assert section["params"]["weight_decay"] == 0.05 and section["params"]["adam_weight_decay"] == 0.2
    assert groups == [{"params": ["0.weight", "3.weight"], "weight_decay": 0.05},
                      {"params": ["0.bias"], "weight_decay": 0.2},
                      {"params": ["1.weight", "1.bias", "3.bias", "5.weight", "5.bias"], "weight_decay": 0.0}]
    # an exact name is a pattern matching only itself
    import fnmatch

    from polyaccel.integrations.lightning import _name_pattern

    assert fnmatch.fnmatchcase("a[1].*?", _name_pattern("a[1].*?")) and not fnmatch.fnmatchcase(
        "a1.xy", _name_pattern("a[1].*?"))


def test_muon_pair_refuses_what_it_cannot_carry():
    net, muon, adam = _pair()
    muon.add_param_group({"params": [net[0].bias]})  # torch checks 2-D at construction only
    adam.param_groups[0]["params"] = [p for p in adam.param_groups[0]["params"] if p is not net[0].bias]
    with pytest.raises(ConfigError, match=r"Muon holds the parameter '0.bias' of shape \(8,\); Muon steps 2-D"):
        _config(muon, adam, net)

    net, muon, adam = _pair()
    adam.param_groups[0]["params"] = adam.param_groups[0]["params"][1:]  # 0.bias in neither optimizer
    with pytest.raises(ConfigError, match=r"leave out the trainable parameter\(s\) '0.bias'"):
        _config(muon, adam, net)

    net, muon, adam = _pair()
    with pytest.raises(ConfigError, match=r"'0.weight' is in both Muon and AdamW"):
        _config(muon, torch.optim.AdamW(_split(net)[1] + [net[0].weight]), net)

    net = _net()
    hidden, rest = _split(net)
    muon = torch.optim.Muon([{"params": hidden[:1]}, {"params": hidden[1:], "momentum": 0.5}])
    with pytest.raises(ConfigError, match=r"Muon's param group 1 has a different 'momentum' than group 0"):
        _config(muon, torch.optim.AdamW(rest), net)
    adam = torch.optim.AdamW([{"params": rest[:1]}, {"params": rest[1:], "betas": (0.5, 0.9)}])
    with pytest.raises(ConfigError, match=r"AdamW's param group 1 has a different 'betas' than group 0"):
        _config(torch.optim.Muon(hidden), adam, net)

    net, muon, adam = _pair(adam_cls=torch.optim.Adam, adam_kw={"weight_decay": 0.01})
    with pytest.raises(ConfigError, match=r"Adam\(weight_decay=0.01\) paired with Muon adds L2 decay"):
        _config(muon, adam, net)
    net, muon, adam = _pair(adam_cls=torch.optim.Adam, adam_kw={"weight_decay": 0.01, "decoupled_weight_decay": True})
    assert _config(muon, adam, net)[0]["params"]["adam_weight_decay"] == 0.01  # decoupled: AdamW's step

    net, muon, adam = _pair(adam_kw={"amsgrad": True})
    with pytest.raises(ConfigError, match=r"AdamW\(amsgrad=True\)"):
        _config(muon, adam, net)
    net, muon, adam = _pair()
    adam.param_groups[0]["centered"] = True
    with pytest.raises(ConfigError, match=r"AdamW's param group holds 'centered'"):
        _config(muon, adam, net)
    net, muon, adam = _pair()
    muon.param_groups[0]["spectral"] = 1
    with pytest.raises(ConfigError, match=r"Muon's param group holds 'spectral'"):
        _config(muon, adam, net)
    net, muon, adam = _pair()
    muon.param_groups[0]["adjust_lr_fn"] = "custom"
    with pytest.raises(ConfigError, match=r"Muon\(adjust_lr_fn='custom'\) has no engine equivalent"):
        _config(muon, adam, net)
    net, muon, _ = _pair()
    with pytest.raises(ConfigError, match=r"pairs torch.optim.Muon with torch.optim.AdamW or Adam .*not SGD"):
        _config(muon, torch.optim.SGD(_split(net)[1], lr=0.1), net)
    with pytest.raises(ConfigError, match=r"leave out the trainable parameter\(s\) '0.bias', '1.weight'"):
        _config(muon, None, net)  # Muon alone must hold every trainable parameter
