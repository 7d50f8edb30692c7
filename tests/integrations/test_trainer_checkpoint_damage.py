"""Damaged and crafted trainer checkpoints are refused on resume, in one line naming the file.

For the Hugging Face ``PolyaccelTrainer`` and the Lightning ``PolyaccelStrategy`` (world size 1, a tiny Llama,
ZeRO stage 2): one run saves a checkpoint; then every file of it, the engine's included, is in turn truncated
to half, altered in one byte and deleted, and a fresh trainer resumes from the copy. Each must raise one
``PolyaccelError`` whose one-line message names that file. Then each file the trainer loads through torch
(``scheduler.pt``, ``rng_state.pth``, ``lightning.pt``) is replaced by a pickle whose ``__reduce__`` opens a
marker file, with the manifest rewritten to match (a crafted checkpoint, not a damaged one): the resume must be
refused naming the file, and the marker must not appear.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

from polyaccel.testing.multiprocess import run_ranks  # noqa: E402

VOCAB, SEQ, MICRO = 61, 8, 2
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1",
       "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false", "PL_DISABLE_FORK": "1"}
DAMAGES = ("truncate", "flip", "delete")


class Payload:
    """Unpickling this opens (creates) ``marker``: code running at load time."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                      tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg)


def token_ids(n: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


def damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def checkpoint_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def outcome(resume, root: Path, rel: str) -> dict:
    """What resuming from ``root`` did: the error's type and message, or that it resumed."""
    from polyaccel.errors import PolyaccelError

    try:
        resume(str(root))
    except PolyaccelError as exc:
        return {"file": rel, "type": type(exc).__name__, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a raw error is a finding, reported by the test
        return {"file": rel, "type": f"raw {type(exc).__name__}", "message": str(exc)}
    return {"file": rel, "type": None, "message": "resumed without an error"}


def matrix(saved: Path, work: Path, resume) -> tuple[list[str], list[dict]]:
    files = checkpoint_files(saved)
    results = []
    for rel in files:
        for how in DAMAGES:
            copy = work / f"{rel.replace('/', '_')}-{how}"
            shutil.copytree(saved, copy)
            damage(copy / rel, how)
            results.append({**outcome(resume, copy, rel), "damage": how})
    return files, results


def crafted(saved: Path, work: Path, resume, rel: str, trainer: str) -> dict:
    """``rel`` replaced by a pickled :class:`Payload` and the manifest rewritten to match."""
    from polyaccel.integrations._checkpoint_files import MANIFEST, write_manifest

    copy = work / f"crafted-{rel}"
    shutil.copytree(saved, copy)
    marker = work / f"marker-{rel}"
    torch.save({"state": Payload(str(marker))}, copy / rel)
    import json

    listed = json.loads((copy / MANIFEST).read_text())["files"]
    write_manifest(copy, list(listed), trainer=trainer)
    return {**outcome(resume, copy, rel), "damage": "payload", "ran": marker.exists()}


# --------------------------------------------------------------------------------------------- Hugging Face
class _Data(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = token_ids()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_matrix(rank, world, out):
    from polyaccel.integrations.transformers import PolyaccelTrainer
    from transformers import TrainingArguments

    os.environ.update(ENV)
    out = Path(out)

    def trainer(steps):
        args = TrainingArguments(output_dir=str(out / "run"), per_device_train_batch_size=MICRO, max_steps=steps,
                                 learning_rate=1e-2, save_strategy="steps", save_steps=2, report_to="none",
                                 use_cpu=True, seed=0, disable_tqdm=True, logging_steps=100)
        return PolyaccelTrainer(model=tiny_llama(), args=args, train_dataset=_Data(),
                                polyaccel_config={"zero_optimization": {"stage": 2}})

    first = trainer(2)
    first.train()
    first.polyaccel_engine.destroy()
    saved = out / "run" / "checkpoint-2"

    kept = []  # a trainer whose train() was refused before it started is reused (they are slow to build)

    def resume(path):
        t = kept.pop() if kept else trainer(3)
        try:
            t.train(resume_from_checkpoint=path)
        finally:
            if t.polyaccel_engine is not None:
                t.polyaccel_engine.destroy()
            else:
                kept.append(t)

    clean = outcome(resume, saved, "")
    files, results = matrix(saved, out / "damaged", resume)
    payloads = [crafted(saved, out, resume, rel, "transformers") for rel in ("scheduler.pt", "rng_state.pth")]
    return {"clean": clean, "files": files, "results": results, "payloads": payloads}


# --------------------------------------------------------------------------------------------- Lightning
def lightning_matrix(rank, world, out):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from polyaccel.integrations.lightning import PolyaccelStrategy

    os.environ.update(ENV)
    out = Path(out)

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = tiny_llama()

        def training_step(self, batch, batch_idx):
            return self.lm(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    def fit(steps, ckpt_path=None, callbacks=()):
        t = pl.Trainer(accelerator="polyaccel", devices=1, strategy=PolyaccelStrategy(stage=2), max_steps=steps,
                       logger=False, enable_progress_bar=False, enable_model_summary=False,
                       enable_checkpointing=bool(callbacks), callbacks=list(callbacks), limit_val_batches=0,
                       num_sanity_val_steps=0, default_root_dir=str(out))
        try:
            t.fit(LM(), torch.utils.data.DataLoader(token_ids(), batch_size=MICRO), ckpt_path=ckpt_path)
        finally:
            engine = getattr(t.strategy, "polyaccel_engine", None)
            if engine is not None:
                engine.destroy()

    fit(2, callbacks=[ModelCheckpoint(dirpath=str(out / "ckpt"), filename="{step}", every_n_train_steps=2,
                                      save_top_k=-1)])
    saved = out / "ckpt" / "step=2.ckpt"

    def resume(path):
        fit(3, ckpt_path=path)

    clean = outcome(resume, saved, "")
    files, results = matrix(saved, out / "damaged", resume)
    payloads = [crafted(saved, out, resume, "lightning.pt", "lightning")]
    return {"clean": clean, "files": files, "results": results, "payloads": payloads}


# --------------------------------------------------------------------------------------------- the checks
#: the trainers' own files (this test's concern); the others are the engine's (engines/zero/checkpoint.py)
OWN = {"hf": {"config.json", "generation_config.json", "model.safetensors", "polyaccel-files.json", "rng_state.pth",
              "scheduler.pt", "trainer_state.json", "training_args.bin"},
       "lightning": {"lightning.pt", "polyaccel-files.json"}}


def _check(kind: str, res: dict) -> None:
    assert res["clean"]["type"] is None, f"the undamaged checkpoint did not resume: {res['clean']}"
    assert OWN[kind] <= set(res["files"]), res["files"]
    silent = [r for r in res["results"] if r["type"] is None]
    wrong = [r for r in res["results"] if r["type"] is not None and (
        r["type"].startswith("raw") or "\n" in r["message"] or os.path.basename(r["file"]) not in r["message"])]
    assert not silent and not wrong, (
        f"{kind}: resumed silently from {[(r['file'], r['damage']) for r in silent]}; refused without naming the "
        f"file in one line: {[(r['file'], r['damage'], r['type'], r['message'][:160]) for r in wrong]}")
    for p in res["payloads"]:
        assert not p["ran"], f"{kind}: the payload in {p['file']} ran when the checkpoint was loaded"
        assert p["type"] == "CheckpointError" and p["file"] in p["message"] and "\n" not in p["message"], p


def test_payload_is_live():
    """The payload the crafted checkpoints carry does run code under a plain unpickler (so its silence proves
    something)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        marker = Path(d) / "marker"
        pickle.loads(pickle.dumps(Payload(str(marker))))  # noqa: S301 - the point: this runs the payload
        assert marker.exists()


@pytest.mark.parametrize("kind", ["hf", "lightning"])
def test_every_file_damaged_or_crafted_is_refused_on_resume(tmp_path, kind):
    fn = hf_matrix if kind == "hf" else lightning_matrix
    (res,) = run_ranks(fn, 1, str(tmp_path), timeout=240, env=ENV)
    _check(kind, res)
