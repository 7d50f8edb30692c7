"""Checkpoints stay layout-free under sequence parallelism (gloo on CPU, float64, one start of 4 ranks).

Sequence ranks are data replicas of every parameter, so nothing in a checkpoint depends on the sequence
degree: a run saved at sp 2 x tp 2 (ZeRO stage 3) resumes at sp 1 (no layer at all: 4 data ranks, stage 2)
and at sp 4 (stage 1), and the continued losses and parameters equal those of the run that never stopped
(1e-10); the saved metadata names no sequence dimension; ``polyaccel zero-to-fp32`` writes the plain Hugging
Face state dict, equal to the model's full state dict at the save.

The model is a tiny Llama (4 query heads, 2 KV heads) whose loss keeps float64 (transformers' own upcasts the
logits to float32; at tp 2 AutoTP's vocab-parallel loss replaces it). Every step trains on the same global
batch of 4 rows, shared out over the batch ranks each layout has, each rank feeding its part of every sequence.
"""

from __future__ import annotations

import pytest
import torch
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(240)

VOCAB, SEQ, ROWS, LR, CLIP = 64, 16, 4, 1e-2, 1.0
BEFORE, AFTER = 2, 2  # steps before the save, and after it
#: (name, config sections of the layers, ZeRO stage) of the runs that resume from the save
RESUMES = [("sp1", {}, 2), ("sp4", {"sequence_parallel": {"autosp_size": 4, "seq_dim": 1}}, 1)]
SAVED = {"sequence_parallel": {"autosp_size": 2, "seq_dim": 1}, "tensor_parallel": {"autotp_size": 2}}


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   **kwargs):
    """transformers' ``ForCausalLMLoss`` without its upcast to float32."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                                             ignore_index=ignore_index, reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def build():
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).double()
    model.loss_function = causal_lm_loss
    return model


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + step))


def config(layers: dict, stage: int) -> dict:
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": 500}, "gradient_clipping": CLIP,
            "optimizer": {"type": "adamw", "params": {"lr": LR, "weight_decay": 0.01}}, **layers}


def steps(engine, first: int, count: int) -> list[float]:
    """``count`` steps from step ``first``; each step's loss of the whole batch (the sequence ranks' shares add
    up, the batch ranks' means and the tensor ranks' copies average)."""
    from polyaccel import comm
    from polyaccel.sequence import split_batch

    mesh, world = engine.mesh, comm.get_world_size()
    b, nb = (mesh.rank("batch"), mesh.size("batch")) if mesh is not None else (comm.get_rank(), world)
    sp = mesh.size("sequence") if mesh is not None else 1
    losses = []
    for step in range(first, first + count):
        ids = global_batch(step)[b * ROWS // nb:(b + 1) * ROWS // nb]
        inputs = {"input_ids": ids, "labels": ids}
        if sp > 1:
            inputs = split_batch(inputs, rank=mesh.rank("sequence"), size=sp)
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().reshape(1).clone()
        comm.all_reduce(t)
        losses.append(t.item() * sp / world)
    return losses


def whole_state(engine) -> dict:
    """The engine's parameters gathered over ZeRO and, where AutoTP split them, over the tensor ranks."""
    import torch.distributed as dist
    from polyaccel.parallel import get_layout

    splits = {n: get_layout(p).split for n, p in engine.module.named_parameters()}
    out = {}
    for name, value in engine.full_state_dict().items():
        split = splits.get(name)
        if split is not None:
            pieces = [None] * engine.mesh.size(split.dim)
            dist.all_gather_object(pieces, value.clone(), group=engine.mesh.group(split.dim))
            value = split.assemble(pieces)
        out[name] = value.clone()
    return out


def ranks_run(rank, world, ckpt):
    import polyaccel

    engine = polyaccel.initialize(build(), config(SAVED, 3))
    out = {"coords": (engine.mesh.rank("sequence"), engine.mesh.rank("tensor"), engine.mesh.rank("batch")),
           "saved": steps(engine, 0, BEFORE)}
    engine.save_checkpoint(ckpt, tag="mid")
    full = whole_state(engine)
    out["never_stopped"] = steps(engine, BEFORE, AFTER)
    out["final"] = {"never_stopped": whole_state(engine)}
    engine.destroy()
    if rank == 0:
        out["at_save"] = full
    for name, layers, stage in RESUMES:
        engine = polyaccel.initialize(build(), config(layers, stage))
        engine.load_checkpoint(ckpt, tag="mid")
        loaded = whole_state(engine)
        out[f"{name}_loaded"] = max(float((loaded[k] - full[k]).abs().max()) for k in full)
        out[name] = steps(engine, BEFORE, AFTER)
        out["final"][name] = whole_state(engine)
        engine.destroy()
    return out


def test_saved_at_sp2_tp2_resumes_at_sp1_and_sp4_and_consolidates(tmp_path):
    from polyaccel.cli import main
    from safetensors.torch import load_file

    ckpt = tmp_path / "ckpt"
    res = run_ranks(ranks_run, 4, str(ckpt), timeout=220)
    assert [r["coords"] for r in res] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]  # sequence 2 x tensor 2
    first = res[0]
    for r in res:  # every rank reports the same whole-batch losses
        assert r["saved"] == pytest.approx(first["saved"], abs=1e-12)
        for name, _, _ in RESUMES:
            assert r[f"{name}_loaded"] == 0.0, name  # loaded bitwise
            diff = max(abs(a - b) for a, b in zip(r[name], first["never_stopped"], strict=True))
            assert diff <= 1e-10, (name, r[name], first["never_stopped"])
            final = r["final"]
            worst = max(float((final[name][k] - final["never_stopped"][k]).abs().max()) for k in final[name])
            assert worst <= 1e-10, (name, worst)

    # nothing in the checkpoint names the sequence degree: the format is the one of any other layout
    meta_text = " ".join(p.read_text() for p in (ckpt / "mid").rglob("*.json"))
    assert meta_text and "sequence" not in meta_text and "autosp" not in meta_text

    out = tmp_path / "model.safetensors"
    assert main(["zero-to-fp32", str(ckpt), str(out)]) == 0
    state = load_file(str(out))
    plain = build()
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state, strict=True)  # the plain Hugging Face model takes it
    at_save = first["at_save"]
    assert set(at_save) <= set(state)
    for k, v in at_save.items():
        assert torch.equal(state[k], v), k
