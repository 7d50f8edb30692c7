"""polyaccel in the Hugging Face Trainer: the optimizer path and the engine path (ZeRO on 2 ranks)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from polyaccel.testing.multiprocess import run_ranks  # noqa: E402

VOCAB, SEQ, MICRO, STEPS = 61, 12, 2, 6
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1",
       "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}


def tiny_llama(seed: int = 0, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg).to(dtype)


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 48):
        g = torch.Generator().manual_seed(123)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)[None, :]) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), per_device_train_batch_size=MICRO, max_steps=STEPS, learning_rate=1e-2,
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
                save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                dataloader_drop_last=True)
    base.update(kw)
    return TrainingArguments(**base)


def _recording(cls):
    class Recording(cls):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.losses, self.batches, self.norms = [], [], []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.batches.append(inputs["input_ids"].clone())
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.losses.append(loss.item())
            return loss

        def log(self, logs, *a, **kw):
            if "grad_norm" in logs:
                self.norms.append(logs["grad_norm"])
            return super().log(logs, *a, **kw)

    return Recording


# --------------------------------------------------------------------------- optimizer path
def test_fused_optimizer_maps_training_arguments(tmp_path):
    import polyaccel
    from polyaccel.integrations.transformers import fused_optimizer

    args = training_args(tmp_path, learning_rate=3e-3, adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-7,
                         weight_decay=0.1)
    cls, kw = fused_optimizer(args)
    assert cls is polyaccel.optim.FusedAdam
    assert kw == {"lr": 3e-3, "betas": (0.8, 0.9), "eps": 1e-7, "weight_decay": 0.1, "adam_w_mode": True}
    cls, kw = fused_optimizer(args, "lion", lr=1e-4)
    assert cls is polyaccel.optim.FusedLion and kw["lr"] == 1e-4 and "eps" not in kw
    with pytest.raises(polyaccel.ConfigError, match="unknown polyaccel optimizer"):
        fused_optimizer(args, "sgd")


def test_optimizer_path_trains_like_torch_adamw(tmp_path):
    """Trainer(optimizer_cls_and_kwargs=fused_optimizer(args)) steps through polyaccel's fused_adam op,
    with the Trainer's weight-decay groups, and matches torch.optim.AdamW."""
    from polyaccel import ops
    from polyaccel.integrations.transformers import fused_optimizer
    from transformers import Trainer

    Rec = _recording(Trainer)
    runs = {}
    calls = []
    for name in ("polyaccel", "torch"):
        args = training_args(tmp_path / name, weight_decay=0.05, max_steps=4)
        kw = {"optimizer_cls_and_kwargs": fused_optimizer(args)} if name == "polyaccel" else {}
        trainer = Rec(model=tiny_llama(), args=args, train_dataset=TokenData(), **kw)
        if name == "polyaccel":
            real = ops.fused_adam

            def counting(*a, _real=real, **k):
                calls.append(1)
                return _real(*a, **k)

            ops.fused_adam = counting
            try:
                trainer.train()
            finally:
                ops.fused_adam = real
            groups = trainer.optimizer.optimizer.param_groups
            assert {g["weight_decay"] for g in groups} == {0.05, 0.0}  # Trainer's decay groups kept
        else:
            trainer.train()
        runs[name] = trainer.losses
    assert len(calls) >= 4  # every optimizer step went through polyaccel.ops.fused_adam
    torch.testing.assert_close(runs["polyaccel"], runs["torch"], rtol=1e-9, atol=0)


# --------------------------------------------------------------------------- engine path
def test_engine_config_from_training_arguments(tmp_path):
    import polyaccel
    from polyaccel.integrations.transformers import engine_config

    args = training_args(tmp_path, gradient_accumulation_steps=2, learning_rate=2e-3, weight_decay=0.1, bf16=True)
    cfg = engine_config(args, {"zero_optimization": {"stage": 3}, "optimizer": {"type": "lion",
                                                                                 "params": {"lr": "auto"}}})
    assert cfg["train_micro_batch_size_per_gpu"] == MICRO and cfg["gradient_accumulation_steps"] == 2
    assert cfg["gradient_clipping"] == 1.0 and cfg["bf16"] == {"enabled": True}
    assert cfg["optimizer"] == {"type": "lion", "params": {"lr": 2e-3, "betas": [0.9, 0.999], "weight_decay": 0.1}}
    with pytest.raises(polyaccel.ConfigError, match="gradient_accumulation_steps"):
        engine_config(args, {"gradient_accumulation_steps": 4})
    with pytest.raises(polyaccel.ConfigError, match="fp16"):
        engine_config(training_args(tmp_path, fp16=True, use_cpu=True), {})


def _hand_driven(config, batches):
    """The engine driven by hand on the batches the Trainer fed this rank: forward, backward, step."""
    import polyaccel

    engine = polyaccel.initialize(tiny_llama(), config=config)
    losses, norms = [], []
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if engine.step():
            norms.append(engine.last_grad_norm)
        losses.append(loss.item())
    state = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.destroy()
    return losses, norms, state


def hf_engine_run(rank, world, stage, gas, out):
    from polyaccel.integrations.transformers import ENGINE_CHECKPOINT_DIR, PolyaccelTrainer
    from safetensors.torch import load_file

    os.environ.update(ENV)
    Rec = _recording(PolyaccelTrainer)
    zero = {"zero_optimization": {"stage": stage}}
    args = training_args(out, save_strategy="steps", save_steps=3, gradient_accumulation_steps=gas)
    trainer = Rec(model=tiny_llama(), args=args, train_dataset=TokenData(), polyaccel_config=zero)
    result = trainer.train()
    engine = trainer.polyaccel_engine
    full = {k: v.clone() for k, v in engine.full_state_dict().items()}
    info = {"builder": engine.optimizer_builder, "global_steps": engine.global_steps,
            "hf_global_step": result.global_step, "stage": engine.stage}
    engine.destroy()

    # resume from the step-3 checkpoint: the remaining steps repeat the first run's
    ckpt = os.path.join(out, "checkpoint-3")
    files = sorted(os.listdir(ckpt))
    saved = load_file(os.path.join(ckpt, "model.safetensors"))
    resumed = Rec(model=tiny_llama(seed=99), args=args, train_dataset=TokenData(), polyaccel_config=zero)
    resumed.train(resume_from_checkpoint=ckpt)
    resumed_full = {k: v.clone() for k, v in resumed.polyaccel_engine.full_state_dict().items()}
    resumed.polyaccel_engine.destroy()

    hand_losses, hand_norms, hand_state = _hand_driven(trainer.polyaccel_config, trainer.batches)
    return {
        "losses": trainer.losses, "hand_losses": hand_losses, "norms": trainer.norms, "hand_norms": hand_norms,
        "resumed_losses": resumed.losses, "files": files, "engine_dir": ENGINE_CHECKPOINT_DIR in files,
        "saved_keys": sorted(saved), "saved_numel": {k: v.numel() for k, v in saved.items()},
        "max_diff_state": max((full[k] - hand_state[k]).abs().max().item() for k in full),
        "max_diff_resumed": max((full[k] - resumed_full[k]).abs().max().item() for k in full),
        **info,
    }


@pytest.mark.parametrize("stage,gas", [(2, 1), (3, 2)])
def test_trainer_engine_path_two_ranks(tmp_path, stage, gas):
    """Trainer.train() through PolyaccelTrainer on 2 ranks: the losses, gradient norms and weights are the
    hand-driven engine's; the checkpoint holds full weights and the engine's shards; resuming from it
    repeats the remaining steps."""
    out = tmp_path / "out"
    res = run_ranks(hf_engine_run, 2, stage, gas, str(out), timeout=240, env=ENV)
    n_micro = STEPS * gas
    for r in res:
        assert r["stage"] == stage and r["global_steps"] == STEPS and r["hf_global_step"] == STEPS
        assert len(r["losses"]) == n_micro
        # HF scales each micro-batch's loss by 1/gas (the engine does the same inside backward)
        torch.testing.assert_close([x * gas for x in r["losses"]], r["hand_losses"], rtol=1e-12, atol=0)
        torch.testing.assert_close(r["norms"], r["hand_norms"], rtol=1e-9, atol=0)
        assert r["max_diff_state"] == 0.0
        assert r["engine_dir"] and {"model.safetensors", "scheduler.pt", "trainer_state.json"} <= set(r["files"])
        assert all(n > 0 for n in r["saved_numel"].values())  # full weights, also in stage 3
        assert "lm_head.weight" in r["saved_keys"]
        half = (STEPS // 2) * gas
        torch.testing.assert_close(r["resumed_losses"], r["losses"][half:], rtol=1e-12, atol=0)
        assert r["max_diff_resumed"] == 0.0
    assert res[0]["losses"] != res[1]["losses"]  # the ranks got different data


def hf_example_plugin_run(rank, world, out):
    import polyaccel
    from polyaccel.integrations.transformers import PolyaccelTrainer
    from transformers import LlamaForCausalLM

    os.environ.update(ENV)
    args = training_args(out, max_steps=2, per_device_eval_batch_size=2)
    trainer = PolyaccelTrainer(model=tiny_llama(), args=args, train_dataset=TokenData(), eval_dataset=TokenData(8),
                               polyaccel_config={"zero_optimization": {"stage": 3}})
    trainer.train()
    metrics = trainer.evaluate()
    final = os.path.join(out, "final")
    trainer.save_model(final)  # every rank: the stage-3 weights are gathered
    full = {k: v.clone() for k, v in trainer.polyaccel_engine.full_state_dict().items()}
    trainer.polyaccel_engine.destroy()
    torch.distributed.barrier()
    reloaded = LlamaForCausalLM.from_pretrained(final, dtype=torch.float64).state_dict()
    return {"selected": polyaccel.get_accelerator().name, "eval_loss": metrics["eval_loss"],
            "reload_diff": max((reloaded[k] - v).abs().max().item() for k, v in full.items())}


def test_trainer_engine_path_on_the_example_plugin_stage3_evaluate_and_save_model(tmp_path):
    """The engine path on the third-party example plugin (POLYACCEL_ACCELERATOR=example): ZeRO-3 training,
    Trainer.evaluate through the engine, and save_model writing the gathered weights from_pretrained reloads."""
    from polyaccel import selection

    assert any(r.name == "example" for r in selection.plugins().usable()), (
        "the example plugin is not installed: pip install ./examples/polyaccel-example-plugin (the README's test "
        "command does)")
    res = run_ranks(hf_example_plugin_run, 2, str(tmp_path / "out"), timeout=240,
                    env=dict(ENV, POLYACCEL_ACCELERATOR="example"))
    for r in res:
        assert r["selected"] == "example" and r["reload_diff"] == 0.0
    assert res[0]["eval_loss"] == res[1]["eval_loss"] > 0
