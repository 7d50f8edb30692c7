"""The model kernels through both trainers: the ``kernels`` section of the engine config reaches
``polyaccel.initialize`` from Hugging Face's ``PolyaccelTrainer`` (``polyaccel_config``) and Lightning's
``PolyaccelStrategy`` (``config``), as ``tensor_parallel`` does. One rank (gloo), a tiny float64 Llama, 3 steps each:
the swapped modules are listed in the plan, the fused loss ran (the Trainer's ``num_items_in_batch`` included), and
the losses equal single-process AdamW on Hugging Face's model (its norms in float64) within 1e-10."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

from polyaccel.testing.multiprocess import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SEQ, MICRO, STEPS, N, LR = 8, 2, 3, 6, 1e-2
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1",
       "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false", "PL_DISABLE_FORK": "1"}
KERNELS = {"rms_norm": True, "rope": True, "swiglu": True, "cross_entropy": True}
HERE = os.path.join(os.path.dirname(__file__), "..", "engines", "kernels")


def _lib():
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import kernels_testlib

    return kernels_testlib


def tokens() -> torch.Tensor:
    return torch.randint(0, _lib().VOCAB, (N, SEQ), generator=torch.Generator().manual_seed(321))


@contextlib.contextmanager
def _counted():
    """Count the fused loss's calls and the num_items each got (wrapping polyaccel.ops.linear_cross_entropy)."""
    from polyaccel import ops

    seen = []
    inner = ops.linear_cross_entropy

    def counted(*a, **k):
        seen.append(k.get("num_items"))
        return inner(*a, **k)

    ops.linear_cross_entropy = counted
    try:
        yield seen
    finally:
        ops.linear_cross_entropy = inner


def hf_run(out):
    from polyaccel.integrations.transformers import PolyaccelTrainer
    from polyaccel.parallel import get_plan
    from transformers import TrainingArguments

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
                             lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
                             save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                             dataloader_drop_last=True)
    trainer = Recording(model=_lib().build("llama"), args=args, train_dataset=Data(),
                        polyaccel_config={"kernels": dict(KERNELS), "zero_optimization": {"stage": 2}})
    with _counted() as seen:
        trainer.train()
    plan = get_plan(trainer.polyaccel_engine.module, "kernels")
    trainer.polyaccel_engine.destroy()
    return {"batches": trainer.batches, "losses": trainer.losses, "swapped": dict(plan.swapped), "num_items": seen}


def lightning_run(out):
    import lightning.pytorch as pl
    from polyaccel.integrations.lightning import PolyaccelStrategy
    from polyaccel.parallel import get_plan

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = _lib().build("llama")
            self.batches, self.losses = [], []

        def training_step(self, batch, batch_idx):
            self.batches.append(batch.clone())
            loss = self.lm(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    module = LM()
    trainer = pl.Trainer(accelerator="polyaccel", devices=1, strategy=PolyaccelStrategy(
        config={"zero_optimization": {"stage": 3}, "kernels": "auto"}), max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
        num_sanity_val_steps=0, default_root_dir=out)
    with _counted() as seen:
        trainer.fit(module, torch.utils.data.DataLoader(tokens(), batch_size=MICRO, shuffle=True))
    plan = get_plan(trainer.strategy.polyaccel_engine.module, "kernels")
    trainer.strategy.polyaccel_engine.destroy()
    return {"batches": module.batches, "losses": module.losses, "swapped": dict(plan.swapped),
            "on": dict(plan.kernels), "num_items": seen}


def both(rank, world, out):
    os.environ.update(ENV)
    torch.set_num_threads(1)
    return {"hf": hf_run(os.path.join(out, "hf")), "lightning": lightning_run(os.path.join(out, "pl"))}


def reference(batches) -> list[float]:
    lib = _lib()
    model = lib.exact_norms(lib.build("llama"))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for ids in batches:
        loss = lib.ce(model(input_ids=ids).logits, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_both_trainers_pass_the_kernels_section_through(tmp_path):
    (res,) = run_ranks(both, 1, str(tmp_path), timeout=280, env=ENV)
    hf, lit = res["hf"], res["lightning"]
    assert hf["swapped"][""] == "cross_entropy" and sum(w == "rms_norm" for w in hf["swapped"].values()) == 5
    assert lit["swapped"]["lm"] == "cross_entropy" and "lm.model.norm" in lit["swapped"]
    # the Trainer passes its token count; the fused loss divides by it
    assert len(hf["num_items"]) == STEPS and all(int(n) == MICRO * (SEQ - 1) for n in hf["num_items"])
    assert lit["num_items"] == [None] * STEPS
    for run in (hf, lit):
        assert len(run["batches"]) == STEPS
        assert run["losses"] == pytest.approx(reference(run["batches"]), rel=1e-10, abs=1e-12)
