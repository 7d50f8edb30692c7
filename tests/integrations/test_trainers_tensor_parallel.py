"""Tensor and expert parallelism through both trainers: the data is sharded over the data axis only.

The ranks of one tensor group hold pieces of one model replica and must see the same batches; expert ranks are
data ranks (expert parallelism is carved out of data parallelism). Each case trains a tiny float64 Qwen3-MoE
(GQA attention, a dense and a MoE layer) on gloo ranks through Hugging Face's ``PolyaccelTrainer`` or Lightning's
``PolyaccelStrategy`` and compares with single-process AdamW (plain torch, clipping) on the global batches the
ranks got, assembled in data-rank order: every loss within 1e-10, and each rank's final weights (its pieces of
the split ones) too.

- tp 2 on 2 ranks: one data rank, both ranks get every batch whole;
- tp 2 x ep 2 on 4 ranks: two data ranks of two tensor ranks each.
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

VOCAB, SEQ, MICRO, STEPS, N = 64, 8, 2, 3, 12
LR, WD, CLIP = 1e-2, 0.01, 1.0
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1",
       "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false", "PL_DISABLE_FORK": "1"}
CASES = {"tp2": (2, {"tensor_parallel": {"autotp_size": 2}}),
         "tp2_ep2": (4, {"tensor_parallel": {"autotp_size": 2}, "expert_parallel": {"autoep_size": 2}})}


def build(seed: int = 0):
    import transformers
    from polyaccel.engines.autoep.models import build_tiny

    transformers.logging.set_verbosity_error()
    return build_tiny("qwen3_moe", torch.float64, seed=seed, vocab=VOCAB, hidden=32, experts=4, ffn=16,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (N, SEQ), generator=torch.Generator().manual_seed(321))


def engine_config(layers: dict, stage: int) -> dict:
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": 2000}, "gradient_clipping": CLIP, **layers}


def _coords(engine) -> dict:
    mesh = engine.mesh
    return {"data": (mesh.rank("data"), mesh.size("data")), "tensor": mesh.rank("tensor")}


def _gathered(engine, prefix: str = "") -> dict:
    """This rank's parameters (gathered over ZeRO) with their splits (AutoTP/AutoEP keep their pieces split), by
    the plain model's names (``prefix``: where the model sits in the trained module)."""
    from polyaccel.parallel import get_layout

    splits = {n: get_layout(p).split for n, p in engine.module.named_parameters()}
    return {k.removeprefix(prefix): (v.clone(), splits.get(k)) for k, v in engine.full_state_dict().items()}


# --------------------------------------------------------------------------------------------- the ranks
def hf_run(rank, world, layers, out):
    from polyaccel.integrations.transformers import PolyaccelTrainer
    from transformers import TrainingArguments

    os.environ.update(ENV)
    ids = tokens()

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    class Recording(PolyaccelTrainer):
        batches, losses = [], []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.batches.append(inputs["input_ids"].clone())
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.losses.append(loss.item())
            return loss

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=MICRO, max_steps=STEPS, learning_rate=LR,
                             lr_scheduler_type="constant", weight_decay=WD, max_grad_norm=CLIP, logging_steps=1,
                             save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                             dataloader_drop_last=True)
    trainer = Recording(model=build(), args=args, train_dataset=Data(), polyaccel_config=engine_config(layers, 2))
    trainer.train()
    engine = trainer.polyaccel_engine
    res = {"batches": trainer.batches, "losses": trainer.losses, "params": _gathered(engine), **_coords(engine),
           "tp_size": trainer.get_tp_size()}
    engine.destroy()
    return res


def lightning_run(rank, world, layers, out):
    import lightning.pytorch as pl
    from polyaccel.integrations.lightning import PolyaccelStrategy

    os.environ.update(ENV)

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = build()
            self.batches, self.losses = [], []

        def training_step(self, batch, batch_idx):
            self.batches.append(batch.clone())
            loss = self.lm(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD)

    module = LM()
    if "expert_parallel" in layers:  # the LightningModule is no Hugging Face model: AutoEP is told the routing rule
        layers = {**layers, "expert_parallel": {**layers["expert_parallel"], "preset_model": "qwen3_moe"}}
    trainer = pl.Trainer(accelerator="polyaccel", devices=world, strategy=PolyaccelStrategy(
        config=engine_config(layers, 3)), max_steps=STEPS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0, gradient_clip_val=CLIP,
        num_sanity_val_steps=0, default_root_dir=out)
    trainer.fit(module, torch.utils.data.DataLoader(tokens(), batch_size=MICRO, shuffle=True))
    engine = trainer.strategy.polyaccel_engine
    res = {"batches": module.batches, "losses": module.losses, "params": _gathered(engine, "lm."), **_coords(engine),
           "sampler": trainer.strategy.distributed_sampler_kwargs}
    engine.destroy()
    return res


# --------------------------------------------------------------------------------------------- the reference
def reference(shards: list[list[torch.Tensor]], hf_decay_split: bool = False):
    """Single-process AdamW with clipping; ``shards[step][d]`` is data rank d's batch. Returns each step's loss of
    every shard (the mean cross entropy a data rank sees) and the final parameters. ``hf_decay_split``: the stock
    HF Trainer's groups (no weight decay on biases and norms), as PolyaccelTrainer passes them to the engine."""
    model = build()
    params = list(model.parameters())
    if hf_decay_split:
        import transformers

        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
        params = [{"params": [p for n, p in model.named_parameters() if n in decay]},
                  {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    losses = []
    for step_shards in shards:
        ids = torch.cat(step_shards)
        logits = model(input_ids=ids).logits
        tok = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1),
                                                reduction="none").view(len(ids), -1)
        losses.append([part.mean().item() for part in tok.split([len(s) for s in step_shards])])
        tok.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _check(res: list[dict], hf_decay_split: bool = False):
    world = len(res)
    tensor = 2
    data = world // tensor
    for r, out in enumerate(res):
        assert out["data"] == (r // tensor, data) and out["tensor"] == r % tensor, out["data"]
        assert len(out["batches"]) == STEPS
    for step in range(STEPS):
        for r in range(world):  # the tensor ranks of one replica got the same batch
            assert torch.equal(res[r]["batches"][step], res[r - r % tensor]["batches"][step]), (step, r)
        if data > 1:  # the data ranks different ones
            assert not torch.equal(res[0]["batches"][step], res[tensor]["batches"][step])
    shards = [[res[d * tensor]["batches"][step] for d in range(data)] for step in range(STEPS)]
    seen = torch.cat([torch.cat(s) for s in shards])
    assert len({tuple(row.tolist()) for row in seen}) == len(seen)  # no sample twice in the window
    ref_losses, ref_params = reference(shards, hf_decay_split)
    for r, out in enumerate(res):
        want = [ref_losses[step][r // tensor] for step in range(STEPS)]
        torch.testing.assert_close(out["losses"], want, rtol=0, atol=1e-10)
        diffs = {k: float((v - (ref_params[k] if split is None else split.piece(ref_params[k]))).abs().max())
                 for k, (v, split) in out["params"].items()}
        assert max(diffs.values()) <= 1e-10, (r, diffs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_trainer_tensor_parallel_equals_one_process(tmp_path, case):
    world, layers = CASES[case]
    res = run_ranks(hf_run, world, layers, str(tmp_path / "hf"), timeout=280, env=ENV)
    assert all(r["tp_size"] == 2 for r in res)  # the Trainer divides its token counts by the shared-batch ranks
    _check(res, hf_decay_split=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_lightning_strategy_tensor_parallel_equals_one_process(tmp_path, case):
    world, layers = CASES[case]
    res = run_ranks(lightning_run, world, layers, str(tmp_path / "pl"), timeout=280, env=ENV)
    for r, out in enumerate(res):
        assert out["sampler"] == {"num_replicas": world // 2, "rank": r // 2}
    _check(res)
