"""polyaccel in PyTorch Lightning: the accelerator registry and PolyaccelStrategy (ZeRO 2 and 3 on 2 ranks)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning")

from polyaccel.testing.multiprocess import run_ranks  # noqa: E402

VOCAB, SEQ, MICRO = 61, 12, 2
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1",
       "PL_DISABLE_FORK": "1"}


def make_module(seed: int = 0, optimizer: str = "adamw"):
    import lightning.pytorch as pl
    from transformers import LlamaConfig, LlamaForCausalLM

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                              tie_word_embeddings=False, use_cache=False)
            self.lm = LlamaForCausalLM(cfg).double()
            self.losses, self.batches = [], []

        def forward(self, ids):
            return self.lm(input_ids=ids, labels=ids).loss

        def training_step(self, batch, batch_idx):
            self.batches.append(batch.clone())
            loss = self(batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            if optimizer == "adamw":
                return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return LM()


def token_data(n: int = 12):
    g = torch.Generator().manual_seed(123)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    return (start + stride * torch.arange(SEQ)[None, :]) % VOCAB


def make_trainer(out, stage, max_steps, **kw):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from polyaccel.integrations.lightning import PolyaccelStrategy

    ckpt = ModelCheckpoint(dirpath=str(out), save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True,
                           filename="{epoch}-{step}")
    return pl.Trainer(accelerator="polyaccel", devices=2, strategy=PolyaccelStrategy(stage=stage),
                      max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ckpt], limit_val_batches=0, gradient_clip_val=1.0, num_sanity_val_steps=0, **kw)


def loader():
    return torch.utils.data.DataLoader(token_data(), batch_size=MICRO, shuffle=True)


def lightning_run(rank, world, stage, optimizer, out):

    os.environ.update(ENV)
    # 12 samples over 2 ranks, 2 per batch: 3 steps an epoch; 6 steps = 2 epochs, a checkpoint after each
    module = make_module(optimizer=optimizer)
    trainer = make_trainer(out, stage, 6)
    trainer.fit(module, loader())
    strategy = trainer.strategy
    engine = strategy.polyaccel_engine
    info = {"stage": engine.stage, "global_step": trainer.global_step, "engine_steps": engine.global_steps,
            "accelerator": type(trainer.accelerator).__name__, "lr": engine.get_lr(),
            "builder": engine.optimizer_builder, "config": strategy.polyaccel_config}
    full = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    engine.destroy()
    ckpts = sorted(os.listdir(out))

    resumed = make_module(seed=7, optimizer=optimizer)
    trainer2 = make_trainer(out + "-resumed", stage, 6)
    trainer2.fit(resumed, loader(), ckpt_path=os.path.join(out, "epoch=0-step=3.ckpt"))
    resumed_full = {k: v.clone() for k, v in trainer2.strategy.full_state_dict().items()}
    resumed_lr = trainer2.strategy.polyaccel_engine.get_lr()
    trainer2.strategy.polyaccel_engine.destroy()

    # the engine driven by hand on the batches Lightning fed this rank, with the config the strategy built; the
    # resumed run continues from the state after the first 3 steps (Lightning's resume from a checkpoint written at
    # the end of an epoch draws its batches in its own way: the hand-driven run takes the ones it got)
    hand_losses, hand_full = _hand_driven(info["config"], module.batches, optimizer)
    hand_resumed_losses, hand_resumed_full = _hand_driven(info["config"], module.batches[:3] + resumed.batches,
                                                          optimizer)
    return {**info, "losses": module.losses, "hand_losses": hand_losses, "resumed_losses": resumed.losses,
            "hand_resumed_losses": hand_resumed_losses[3:],
            "ckpts": ckpts, "ckpt_files": sorted(os.listdir(os.path.join(out, "epoch=0-step=3.ckpt"))),
            "resumed_lr": resumed_lr, "resumed_first_batch_same": torch.equal(resumed.batches[0], module.batches[3]),
            "diff_hand": max((full[k] - hand_full[k]).abs().max().item() for k in full),
            "diff_resumed": max((resumed_full[k] - hand_resumed_full[k]).abs().max().item() for k in full)}


def _hand_driven(config, batches, optimizer):
    import polyaccel

    hand = make_module(optimizer=optimizer)
    eng = polyaccel.initialize(hand, config=config)
    losses = []
    for i, ids in enumerate(batches):
        if optimizer == "adam":  # StepLR(step_size=2, gamma=0.5), stepped after each optimizer step
            eng.set_lr(1e-2 * 0.5 ** (i // 2))
        loss = eng(ids)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    full = {k: v.clone() for k, v in eng.full_state_dict().items()}
    eng.destroy()
    return losses, full


@pytest.mark.parametrize("stage,optimizer", [(2, "adamw"), (3, "adam")])
def test_fit_two_ranks_equals_hand_driven_engine(tmp_path, stage, optimizer):
    """Trainer.fit with accelerator='polyaccel' and PolyaccelStrategy on 2 ranks: losses and weights equal the
    engine driven by hand on the same batches; resuming from the epoch-0 checkpoint restores the weights, the
    optimizer state and the LR schedule (the resumed steps equal the hand-driven engine continued on them)."""
    res = run_ranks(lightning_run, 2, stage, optimizer, str(tmp_path / "ckpt"), timeout=240, env=ENV)
    for r in res:
        assert r["accelerator"] == "PolyaccelAccelerator"
        assert r["stage"] == stage and r["global_step"] == 6 and r["engine_steps"] == 6
        assert r["config"]["gradient_clipping"] == 1.0
        assert r["config"]["optimizer"]["type"] == ("adamw" if optimizer == "adamw" else "adam")
        assert len(r["losses"]) == 6
        torch.testing.assert_close(r["losses"], r["hand_losses"], rtol=1e-12, atol=0)
        assert r["diff_hand"] == 0.0
        assert r["ckpts"] == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
        assert "lightning.pt" in r["ckpt_files"] and "latest" in r["ckpt_files"]
        assert r["resumed_first_batch_same"]
        torch.testing.assert_close(r["resumed_losses"][0], r["losses"][3], rtol=1e-12, atol=0)
        torch.testing.assert_close(r["resumed_losses"], r["hand_resumed_losses"], rtol=1e-12, atol=0)
        assert r["diff_resumed"] == 0.0
        assert r["resumed_lr"] == r["lr"]
    assert res[0]["losses"] != res[1]["losses"]


# --------------------------------------------------------------------------- accelerator registry, one device
def test_accelerators_registered_under_polyaccel_and_plugin_names():
    from lightning.pytorch.accelerators import AcceleratorRegistry, CPUAccelerator
    from polyaccel import selection
    from polyaccel.integrations.lightning import PolyaccelAccelerator, register_accelerators

    register_accelerators(AcceleratorRegistry)  # idempotent; picks up plugins discovered since the import
    assert AcceleratorRegistry["polyaccel"]["accelerator"] is PolyaccelAccelerator
    assert AcceleratorRegistry["cpu"]["accelerator"] is CPUAccelerator  # Lightning's own names are left alone
    assert PolyaccelAccelerator.is_available() and PolyaccelAccelerator.name() == "polyaccel"
    assert PolyaccelAccelerator.parse_devices("auto") == 1 and PolyaccelAccelerator.parse_devices(2) == 2
    assert PolyaccelAccelerator.get_parallel_devices(2) == [torch.device("cpu")] * 2
    names = {r.accelerator_cls.name for r in selection.plugins().usable() if r.accelerator_cls is not None}
    if "example" in names:  # the example third-party plugin, when installed
        cls = AcceleratorRegistry["example"]["accelerator"]
        assert issubclass(cls, PolyaccelAccelerator) and cls.plugin == "example" and cls.is_available()


def one_device_run(rank, world, accelerator, strategy, out):
    import lightning.pytorch as pl
    import polyaccel
    from polyaccel.integrations.lightning import register

    register()  # the names alone ("polyaccel", "example") reach Lightning through register(), not the import
    os.environ.update(ENV)
    module = make_module()
    trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=out)
    trainer.fit(module, torch.utils.data.DataLoader(token_data(), batch_size=MICRO))
    engine = getattr(trainer.strategy, "polyaccel_engine", None)
    return {"selected": polyaccel.get_accelerator().name, "strategy": type(trainer.strategy).__name__,
            "root": str(trainer.strategy.root_device), "losses": module.losses,
            "builder": engine.optimizer_builder if engine is not None else None}


@pytest.mark.parametrize("accelerator,strategy", [("polyaccel", "auto"), ("example", "polyaccel")])
def test_one_device(tmp_path, accelerator, strategy):
    """One device: Lightning's default single-device strategy runs on the polyaccel accelerator; a plugin chosen by
    its own name ('example', the third-party example plugin) is selected in polyaccel and the engine runs on it."""
    if accelerator == "example":
        from polyaccel import selection

        assert any(r.name == "example" for r in selection.plugins().usable()), (
            "the example plugin is not installed: pip install ./examples/polyaccel-example-plugin (the README's test "
            "command does)")
    (res,) = run_ranks(one_device_run, 1, accelerator, strategy, str(tmp_path), timeout=120, env=ENV)
    assert len(res["losses"]) == 2 and res["losses"][1] < res["losses"][0]
    assert res["root"] == "cpu"
    if accelerator == "example":
        assert res["selected"] == "example" and res["strategy"] == "PolyaccelStrategy" and res["builder"]
    else:
        assert res["strategy"] == "SingleDeviceStrategy"


def accumulate_run(rank, world, out):
    import lightning.pytorch as pl
    import polyaccel
    from polyaccel.integrations.lightning import PolyaccelStrategy

    os.environ.update(ENV)
    module = make_module()
    trainer = pl.Trainer(accelerator="polyaccel", devices=2, strategy=PolyaccelStrategy(stage=2),
                         precision="bf16-mixed", accumulate_grad_batches=2, max_steps=3, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         limit_val_batches=0, default_root_dir=out)
    trainer.fit(module, loader())
    engine = trainer.strategy.polyaccel_engine
    info = {"global_step": trainer.global_step, "engine_steps": engine.global_steps,
            "dtype": str(engine.compute_dtype), "config": trainer.strategy.polyaccel_config}
    engine.destroy()
    # by hand: Lightning divides each loss by accumulate_grad_batches and steps after batches 2, 3 (end of the
    # 3-batch epoch) and 5
    eng = polyaccel.initialize(make_module(), config=info["config"])
    hand = []
    for i, ids in enumerate(module.batches):
        loss = eng(ids)
        eng.backward(loss / 2)
        if i in (1, 2, 4):
            eng.step()
        hand.append(loss.item())
    info["hand_steps"] = eng.global_steps
    eng.destroy()
    return {**info, "losses": module.losses, "hand_losses": hand}


def test_accumulate_grad_batches_and_bf16(tmp_path):
    """accumulate_grad_batches=2 stays Lightning's (global_step counts optimizer steps, a short window at the
    end of an epoch steps too) and precision='bf16-mixed' is the engine's bf16: losses equal the hand-driven
    engine with the same accumulation."""
    res = run_ranks(accumulate_run, 2, str(tmp_path), timeout=240, env=ENV)
    for r in res:
        assert r["global_step"] == 3 and r["engine_steps"] == 3 and r["hand_steps"] == 3
        assert r["dtype"] == "torch.bfloat16" and r["config"]["bf16"] == {"enabled": True}
        assert len(r["losses"]) == 5
        assert r["losses"] == r["hand_losses"]
