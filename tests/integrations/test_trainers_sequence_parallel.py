"""Sequence parallelism (AutoSP) through both trainers: the sequence ranks get the same rows, each feeds its part
of every sequence, and the loss the trainer reports is the whole sequence's.

Each case trains a tiny float64 Llama (4 query heads, 2 KV heads) on 2 gloo ranks at sequence size 2 (one data
rank) through Hugging Face's ``PolyaccelTrainer`` (right-padded rows: an attention mask and ignored labels, so the
two halves of a sequence hold different numbers of tokens) or Lightning's ``PolyaccelStrategy`` (ZeRO stage 3),
and compares with single-process AdamW (plain torch, clipping) on the whole sequences the two ranks' halves make:
every reported loss within 1e-10 and the final weights too.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

from polyaccel.testing.multiprocess import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(300)

VOCAB, SEQ, MICRO, STEPS, N = 64, 8, 2, 3, 6
LR, WD, CLIP = 1e-2, 0.01, 1.0
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1",
       "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false", "PL_DISABLE_FORK": "1"}
SP = {"sequence_parallel": {"autosp_size": 2, "seq_dim": 1}}


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   **kwargs):
    """transformers' ``ForCausalLMLoss`` without its upcast to float32 (float64 stays float64)."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                                             ignore_index=ignore_index, reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def build(seed: int = 0):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).double()
    model.loss_function = causal_lm_loss  # transformers' own computes in float32, whatever the model's dtype
    return model


def rows() -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, valid lengths): random tokens, each row right-padded after a length of 3..SEQ."""
    g = torch.Generator().manual_seed(321)
    return torch.randint(0, VOCAB, (N, SEQ), generator=g), torch.randint(3, SEQ + 1, (N,), generator=g)


def padded(i: int) -> dict:
    ids, lengths = rows()
    mask = (torch.arange(SEQ) < lengths[i]).long()
    return {"input_ids": ids[i], "attention_mask": mask, "labels": ids[i].masked_fill(mask == 0, -100)}


def _gathered(engine, prefix: str = "") -> dict:
    return {k.removeprefix(prefix): v.clone() for k, v in engine.full_state_dict().items()}


# --------------------------------------------------------------------------------------------- the ranks
def hf_run(rank, world, out):
    from polyaccel.integrations.transformers import PolyaccelTrainer
    from transformers import TrainingArguments

    os.environ.update(ENV)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return padded(i)

    class Recording(PolyaccelTrainer):
        parts, losses = [], []

        def compute_loss(self, model, inputs, *args, **kwargs):
            self.parts.append({k: inputs[k].clone() for k in ("input_ids", "position_ids", "labels")})
            return super().compute_loss(model, inputs, *args, **kwargs)

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.losses.append(loss.item())
            return loss

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=MICRO, max_steps=STEPS, learning_rate=LR,
                             lr_scheduler_type="constant", weight_decay=WD, max_grad_norm=CLIP, logging_steps=1,
                             save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                             dataloader_drop_last=True, per_device_eval_batch_size=MICRO)
    trainer = Recording(model=build(), args=args, train_dataset=Data(),
                        polyaccel_config={"zero_optimization": {"stage": 2}, **SP})
    trainer.train()
    engine = trainer.polyaccel_engine
    evaluated = trainer.evaluate(Data())["eval_loss"]  # the loss only: the logits stay cut over the ranks
    refused = None
    try:
        trainer.predict(Data())
    except Exception as exc:  # noqa: BLE001 - the refusal is what is checked
        refused = f"{type(exc).__name__}: {exc}"
    res = {"parts": trainer.parts, "losses": trainer.losses, "params": _gathered(engine), "refused": refused,
           "evaluated": evaluated,
           "logged": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "seq": (engine.mesh.rank("sequence"), engine.mesh.size("sequence")), "tp_size": trainer.get_tp_size()}
    engine.destroy()
    return res


def lightning_run(rank, world, out):
    import lightning.pytorch as pl
    from polyaccel.integrations.lightning import PolyaccelStrategy

    os.environ.update(ENV)

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = build()
            self.parts, self.losses = [], []

        # the sequence_parallel layer works on a Hugging Face model: its config and the decoder it prepares
        @property
        def config(self):
            return self.lm.config

        @property
        def base_model(self):
            return self.lm.base_model

        def training_step(self, batch, batch_idx):
            self.parts.append({k: batch[k].clone() for k in ("input_ids", "position_ids", "labels")})
            return self.lm(**batch).loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].item())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD)

    ids = rows()[0]
    data = [{"input_ids": ids[i], "labels": ids[i]} for i in range(N)]
    module = LM()
    trainer = pl.Trainer(accelerator="polyaccel", devices=world, strategy=PolyaccelStrategy(
        config={"zero_optimization": {"stage": 3}, **SP}), max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
        gradient_clip_val=CLIP, num_sanity_val_steps=0, default_root_dir=out)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=True))
    strategy = trainer.strategy
    engine = strategy.polyaccel_engine
    res = {"parts": module.parts, "losses": module.losses, "params": _gathered(engine, "lm."),
           "sampler": strategy.distributed_sampler_kwargs,  # and a value to log, summed over the sequence group
           "sequence_loss": strategy.sequence_loss(torch.tensor(rank + 1.5, dtype=torch.float64)).item()}
    engine.destroy()
    return res


# --------------------------------------------------------------------------------------------- the reference
def reference(batches: list[dict], hf_decay_split: bool = False, evaluate: list[dict] = ()):
    """Single-process AdamW with clipping on the whole sequences; each step's loss and the final parameters (and,
    with ``evaluate``, the trained model's mean loss over those batches, weighted by their rows)."""
    model = build()
    params = list(model.parameters())
    if hf_decay_split:
        import transformers

        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
        params = [{"params": [p for n, p in model.named_parameters() if n in decay]},
                  {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    params = {k: v.detach() for k, v in model.named_parameters()}
    if evaluate:
        model.eval()
        with torch.no_grad():
            per_row = [model(**b).loss.item() for b in evaluate for _ in range(len(b["input_ids"]))]
        return losses, params, sum(per_row) / len(per_row)
    return losses, params


def _whole(res: list[dict]) -> list[torch.Tensor]:
    """Each step's whole sequences from the two ranks' halves, after checking they are halves of the same rows:
    rank r holds positions [r*SEQ/2, (r+1)*SEQ/2), with global position ids and labels shifted globally."""
    whole = []
    for step in range(STEPS):
        a, b = res[0]["parts"][step], res[1]["parts"][step]
        ids = torch.cat([a["input_ids"], b["input_ids"]], dim=1)
        assert ids.shape == (MICRO, SEQ)
        assert torch.equal(torch.cat([a["position_ids"], b["position_ids"]], dim=1),
                           torch.arange(SEQ).expand(MICRO, SEQ))
        labels = torch.cat([a["labels"], b["labels"]], dim=1)
        assert torch.equal(labels[:, :-1][labels[:, :-1] != -100], ids[:, 1:][labels[:, :-1] != -100])
        assert (labels[:, -1] == -100).all()
        whole.append(ids)
    return whole


def _check_losses_and_params(res, want_losses, want_params):
    for out in res:
        torch.testing.assert_close(out["losses"], want_losses, rtol=0, atol=1e-10)
        diffs = {k: float((v - want_params[k]).abs().max()) for k, v in out["params"].items()}
        assert max(diffs.values()) <= 1e-10, diffs


def test_hf_trainer_sequence_parallel_equals_one_process(tmp_path):
    res = run_ranks(hf_run, 2, str(tmp_path / "hf"), timeout=280, env=ENV)
    assert [r["seq"] for r in res] == [(0, 2), (1, 2)] and all(r["tp_size"] == 2 for r in res)
    whole = _whole(res)
    ids, lengths = rows()
    by_row = {tuple(ids[i].tolist()): i for i in range(N)}
    batches = []
    for step_ids in whole:
        index = [by_row[tuple(r.tolist())] for r in step_ids]  # every sample once in the epoch's window
        items = [padded(i) for i in index]
        batches.append({k: torch.stack([it[k] for it in items]) for k in items[0]})
    assert len({i for s in whole for i in (by_row[tuple(r.tolist())] for r in s)}) == STEPS * MICRO
    assert len({int(lengths[by_row[tuple(r.tolist())]]) for s in whole for r in s}) > 1  # padded unevenly
    items = [padded(i) for i in range(N)]  # evaluation: the rows in order, MICRO at a time
    evaluate = [{k: torch.stack([it[k] for it in items[i:i + MICRO]]) for k in items[0]} for i in range(0, N, MICRO)]
    want_losses, want_params, want_eval = reference(batches, hf_decay_split=True, evaluate=evaluate)
    _check_losses_and_params(res, want_losses, want_params)
    for r in res:  # the Trainer's logged loss is the whole sequence's too (its running sum is a float32 tensor)
        torch.testing.assert_close(r["logged"], want_losses, rtol=1e-6, atol=0)
        assert abs(r["evaluated"] - want_eval) <= 1e-10, (r["evaluated"], want_eval)
        assert r["refused"] and r["refused"].startswith("ConfigError: PolyaccelTrainer with sequence_parallel "
                                                        "(sequence size 2) evaluates the loss only")


def test_lightning_strategy_sequence_parallel_equals_one_process(tmp_path):
    res = run_ranks(lightning_run, 2, str(tmp_path / "pl"), timeout=280, env=ENV)
    assert all(r["sampler"] == {"num_replicas": 1, "rank": 0} and r["sequence_loss"] == 4.0 for r in res)
    whole = _whole(res)
    want_losses, want_params = reference([{"input_ids": ids, "labels": ids} for ids in whole])
    _check_losses_and_params(res, want_losses, want_params)
