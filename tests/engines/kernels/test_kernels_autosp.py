"""The kernels layer after AutoSP (ORDER 30 > 25): 2 gloo ranks at sp 2, ZeRO stage 2, a tiny Llama in float64, the
AutoSP tests' plain, padded and packed batches. Each rank's loss is the fused cross-entropy of its part of the
sequence against AutoSP's ``shift_labels`` over the whole group's ``num_items_in_batch``; 10 AdamW steps with
clipping equal one process on the whole sequences (the reference's norms in float64) within 1e-10."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from kernels_testlib import ALL_ON, exact_norms
from polyaccel.testing.multiprocess import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "autosp"))
import autosp_testlib as sp  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def fused_sp_loss(engine, b: dict) -> torch.Tensor:
    from polyaccel.sequence import split_batch

    mesh = engine.mesh
    part = split_batch(sp.rows(b, mesh.rank("batch"), mesh.size("batch")), rank=mesh.rank("sequence"),
                       size=mesh.size("sequence"))
    kw = {k: part[k] for k in ("attention_mask", "position_ids") if k in part}
    out = engine(input_ids=part["input_ids"], labels=part["labels"], shift_labels=part["shift_labels"],
                 num_items_in_batch=part["num_items_in_batch"], **kw)
    assert out.logits is None  # the fused loss ran
    return out.loss


def _rank(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    llama = sp.BUILDERS["llama"]
    sp.BUILDERS["llama"] = lambda **kw: exact_norms(llama(**kw))
    sp.sp_loss = fused_sp_loss
    cfg = {**sp.engine_config(2, 2, 1), "kernels": dict(ALL_ON)}
    got = sp.train("llama", cfg)
    return {"got": got, "ref": sp.reference("llama", 1, 1)}


def test_autosp_then_kernels_trains_like_one_process():
    for out in run_ranks(_rank, 2, timeout=280):
        sp.assert_matches(out["got"], out["ref"], "llama sp 2 with kernels")
