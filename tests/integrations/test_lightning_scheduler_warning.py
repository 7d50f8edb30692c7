"""PolyaccelStrategy with an LR scheduler from ``configure_optimizers``: no "lr_scheduler.step() before
optimizer.step()" warning (stock DDP shows none either), and the schedule is the one stock DDP follows."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("lightning")

from polyaccel.testing.multiprocess import run_ranks  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1"}
STEPS = 4
ORDER_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


def _fit(strategy_name: str, out: str) -> dict:
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1)).double()
            self.lrs, self.losses = [], []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    g = torch.Generator().manual_seed(5)
    x = torch.randn(STEPS * 2, 6, generator=g, dtype=torch.float64)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    if strategy_name == "polyaccel":
        from polyaccel.integrations.lightning import PolyaccelStrategy

        kwargs = {"accelerator": "polyaccel", "strategy": PolyaccelStrategy(stage=2)}
    else:
        kwargs = {"accelerator": "cpu", "strategy": "ddp"}
    module = Regression()
    trainer = pl.Trainer(devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                         num_sanity_val_steps=0, default_root_dir=out, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    if strategy_name == "polyaccel":
        trainer.strategy.polyaccel_engine.destroy()
    return {"warnings": [str(w.message) for w in caught], "lrs": module.lrs, "losses": module.losses}


def fit_both(rank, world, out):
    os.environ.update(ENV)
    return {name: _fit(name, os.path.join(out, name)) for name in ("polyaccel", "ddp")}


def test_no_scheduler_order_warning_and_the_schedule_of_stock_ddp(tmp_path):
    (res,) = run_ranks(fit_both, 1, str(tmp_path), timeout=180, env=ENV)
    for name in ("polyaccel", "ddp"):
        assert not [w for w in res[name]["warnings"] if ORDER_WARNING in w], (name, res[name]["warnings"])
        assert not [w for w in res[name]["warnings"] if "optimizer.step()` has been overridden" in w], name
    assert res["polyaccel"]["lrs"] == res["ddp"]["lrs"] == [0.1 * 0.5 ** i for i in range(STEPS)]
    torch.testing.assert_close(res["polyaccel"]["losses"], res["ddp"]["losses"], rtol=1e-10, atol=0)
