"""PolyaccelStrategy takes the weight decay of each param group of the optimizer ``configure_optimizers`` returns:
training equals torch's AdamW with those groups (float64); groups that differ in anything else are refused."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning")

from polyaccel.errors import ConfigError  # noqa: E402
from polyaccel.testing.multiprocess import run_ranks  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1"}
LR, STEPS = 2e-2, 6


def _net():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    with torch.no_grad():  # the norm starts at ones and zeros: move it so a wrong decay shows at once
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return net.double()


def _groups(net, wd=0.1):
    decay = [p for n, p in net.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in net.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def make_module():
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()
            self.batches = []

        def training_step(self, batch, batch_idx):
            self.batches.append(batch.clone())
            return self.net(batch).sin().square().mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(_groups(self.net), lr=LR)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Module()


def lightning_groups(rank, world, out):
    import lightning.pytorch as pl
    from polyaccel.integrations.lightning import PolyaccelStrategy

    os.environ.update(ENV)
    torch.set_num_threads(1)
    data = torch.randn(24, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    res = {}
    for stage in (2, 3):
        module = make_module()
        trainer = pl.Trainer(accelerator="polyaccel", devices=1, strategy=PolyaccelStrategy(stage=stage),
                             precision="64-true", max_steps=STEPS, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                             default_root_dir=out)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
        engine = trainer.strategy.polyaccel_engine
        full = {k: v.clone() for k, v in engine.full_state_dict().items()}
        decays = dict(engine.weight_decays)
        engine.destroy()

        ref = _net()
        opt = torch.optim.AdamW(_groups(ref), lr=LR)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for batch in module.batches:
            ref(batch).sin().square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        res[stage] = {"steps": len(module.batches), "decays": decays,
                      "diff": max((full[f"net.{n}"] - p.detach()).abs().max().item()
                                  for n, p in ref.named_parameters())}
    return res


def test_configure_optimizers_groups_train_like_torch(tmp_path):
    (r,) = run_ranks(lightning_groups, 1, str(tmp_path), timeout=180, env=ENV)
    for stage in (2, 3):
        assert r[stage]["steps"] == STEPS
        assert r[stage]["diff"] < 1e-10, (stage, r[stage]["diff"])
        assert r[stage]["decays"] == {"net.0.weight": 0.1, "net.3.weight": 0.1, "net.0.bias": 0.0,
                                      "net.1.weight": 0.0, "net.1.bias": 0.0, "net.3.bias": 0.0}


def test_groups_differing_beyond_weight_decay_are_refused():
    from polyaccel.integrations.lightning import optimizer_config, weight_decay_groups

    net = _net()
    groups = _groups(net)
    groups[1]["lr"] = 1e-3
    with pytest.raises(ConfigError, match=r"AdamW's param group 1 has a different 'lr' than group 0; the polyaccel "
                                          r"engine varies only weight_decay per group"):
        optimizer_config(torch.optim.AdamW(groups, lr=LR))
    cfg = optimizer_config(torch.optim.AdamW(_groups(net, wd=0.2), lr=LR, weight_decay=0.05))
    assert cfg == {"type": "adamw", "params": {"lr": LR, "weight_decay": 0.05, "betas": [0.9, 0.999], "eps": 1e-8}}
    stray = torch.optim.AdamW([{"params": list(net.parameters())},
                               {"params": [torch.nn.Parameter(torch.zeros(2, 3))], "weight_decay": 0.0}])
    with pytest.raises(ConfigError, match=r"param group 1 holds a tensor of shape \(2, 3\) that is not a parameter"):
        weight_decay_groups(stray, net)
