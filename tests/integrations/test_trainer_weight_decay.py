"""PolyaccelTrainer's weight decay is the stock Trainer's split (no decay on biases and norms), and a step the
engine skips for an fp16 overflow leaves the LR scheduler where the stock Trainer leaves it (not advanced)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from polyaccel.testing.multiprocess import run_ranks  # noqa: E402

VOCAB, SEQ, MICRO = 61, 12, 2
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1",
       "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}


def tiny_llama(dtype):
    """Biases in attention and MLP, RMSNorms: both kinds the Trainer keeps out of weight decay."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=False, use_cache=False, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms start at one, biases at zero: move them so a wrong decay shows at once
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return model.to(dtype)


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 32):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), per_device_train_batch_size=MICRO, max_steps=6, learning_rate=2e-2,
                lr_scheduler_type="constant", weight_decay=0.1, max_grad_norm=0.0, optim="adamw_torch",
                save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                dataloader_drop_last=True, logging_steps=1)
    base.update(kw)
    return TrainingArguments(**base)


def _recording(cls):
    class Recording(cls):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.batches, self.logged_lrs, self.skipped = [], [], []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.batches.append(inputs["input_ids"].clone())
            return super().training_step(model, inputs, num_items_in_batch)

        def log(self, logs, *a, **kw):
            if "learning_rate" in logs:
                self.logged_lrs.append(logs["learning_rate"])
            return super().log(logs, *a, **kw)

    return Recording


def decay_and_skip(rank, world, out):
    from polyaccel.integrations.transformers import PolyaccelTrainer
    from transformers import Trainer, TrainerCallback

    os.environ.update(ENV)
    torch.set_num_threads(1)
    res = {}

    # the decay split: stock Trainer (torch AdamW over create_optimizer's two groups) vs the engine path
    stock = _recording(Trainer)(model=tiny_llama(torch.float64), args=_args(out + "/stock"),
                                train_dataset=TokenData())
    stock.train()
    by_id = {id(p): n for n, p in stock.model.named_parameters()}
    res["stock_no_decay"] = sorted(by_id[id(p)] for g in stock.optimizer.param_groups if g["weight_decay"] == 0.0
                                   for p in g["params"])
    poly = _recording(PolyaccelTrainer)(model=tiny_llama(torch.float64), args=_args(out + "/poly"),
                                        train_dataset=TokenData(),
                                        polyaccel_config={"zero_optimization": {"stage": 2}})
    poly.train()
    engine = poly.polyaccel_engine
    res["engine_decays"] = dict(engine.weight_decays)
    res["same_batches"] = all(torch.equal(a, b) for a, b in zip(stock.batches, poly.batches, strict=True))
    full = engine.full_state_dict()
    res["max_diff"] = max((full[n] - p.detach()).abs().max().item() for n, p in stock.model.named_parameters())
    engine.destroy()

    # fp16 overflow: the first steps overflow (scale 2^24) and are skipped; the scheduler advances on applied
    # steps only, as the stock Trainer does when accelerate reports the optimizer step skipped
    skipped = []

    class Skips(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kw):
            skipped.append(bool(fp16.polyaccel_engine.last_step_skipped))

    args = _args(out + "/fp16", max_steps=8, lr_scheduler_type="linear", warmup_steps=3, weight_decay=0.0)
    fp16 = _recording(PolyaccelTrainer)(
        model=tiny_llama(torch.float32), args=args, train_dataset=TokenData(), callbacks=[Skips()],
        polyaccel_config={"zero_optimization": {"stage": 2},
                          "fp16": {"enabled": True, "initial_scale_power": 24, "hysteresis": 1}})
    fp16.train()
    from transformers import get_scheduler

    ref_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.learning_rate)
    ref = get_scheduler("linear", ref_opt, num_warmup_steps=3, num_training_steps=8)
    want = []
    for was_skipped in skipped:  # the lr each step ran with, then the scheduler moves only past an applied step
        want.append(ref.get_last_lr()[0])
        if not was_skipped:
            ref.step()
    res.update(skipped=skipped, engine_skipped=fp16.polyaccel_engine.skipped_steps,
               logged_lrs=fp16.logged_lrs, want_lrs=want, last_epoch=fp16.lr_scheduler.last_epoch,
               want_last_epoch=ref.last_epoch)
    fp16.polyaccel_engine.destroy()
    return res


def test_decay_split_and_skipped_step_schedule(tmp_path):
    (r,) = run_ranks(decay_and_skip, 1, str(tmp_path), timeout=240, env=ENV)
    # the same batches, the same weights as torch's AdamW over the stock Trainer's two groups (float64)
    assert r["same_batches"]
    assert r["max_diff"] < 1e-10, r["max_diff"]
    # the engine's zero-decay parameters are exactly the stock Trainer's no-decay group
    assert r["stock_no_decay"] and sorted(r["engine_decays"]) == r["stock_no_decay"]
    assert set(r["engine_decays"].values()) == {0.0}
    assert any(n.endswith("bias") for n in r["stock_no_decay"]) and any("norm" in n for n in r["stock_no_decay"])
    # some steps were skipped, not all; the scheduler stands where the stock rule leaves it
    assert 0 < r["engine_skipped"] < len(r["skipped"]) == 8
    assert sum(r["skipped"]) == r["engine_skipped"] and r["skipped"][0]
    assert r["last_epoch"] == r["want_last_epoch"] == 8 - r["engine_skipped"]
    torch.testing.assert_close(r["logged_lrs"], r["want_lrs"], rtol=1e-12, atol=0)
