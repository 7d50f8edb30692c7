"""Models, batches and the single-process reference of the AutoSP tests (float64).

Batches cycle through three kinds, so one 10-step run covers them all: plain (a few labels
ignored), padded (left padding: a 2-D ``attention_mask`` and ignored labels on the pads) and packed
(no mask; ``position_ids`` restart where a document starts, and the first label of each later
document is ignored, as transformers' flattening collator does). The reference trains the unsplit
model on the whole sequences with torch's AdamW and clipping; its loss is the next-token cross
entropy computed here from the logits (logits[:, :-1] against labels[:, 1:]), in float64, averaged
over each data-parallel share's tokens, then over shares and micro-batches, as the engine does.
"""

from __future__ import annotations

import torch

VOCAB, SEQ, ROWS = 64, 16, 2
STEPS, LR, WD, CLIP = 10, 1e-2, 0.01, 0.5
KINDS = ("plain", "padded", "packed")


def quiet():
    import transformers

    transformers.logging.set_verbosity_error()


def llama(seed: int = 0, impl: str = "sdpa"):
    """Tiny Llama: GQA 4 query heads over 2 KV heads (at sp 4 each KV head is copied twice)."""
    import transformers

    quiet()
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    cfg._attn_implementation = impl
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(torch.float64)


def qwen2_sliding(seed: int = 0, impl: str = "sdpa"):
    """Tiny Qwen2 with a sliding-window layer (window 5 < SEQ) before a full-attention one."""
    import transformers

    quiet()
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                   use_sliding_window=True, sliding_window=5, max_window_layers=0,
                                   layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    cfg._attn_implementation = impl
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(cfg).to(torch.float64)


def qwen3_moe(seed: int = 0):
    """The composed tests' tiny Qwen3-MoE (4 heads over 2 KV heads, q/k norms, one MoE layer of 4 experts)."""
    from polyaccel.engines.autoep.models import build_tiny

    quiet()
    return build_tiny("qwen3_moe", torch.float64, seed=seed, vocab=VOCAB, hidden=32, experts=4, ffn=16,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)


BUILDERS = {"llama": llama, "qwen2_sliding": qwen2_sliding, "qwen3_moe": qwen3_moe}


def batch(step: int, micro: int = 0, kinds=KINDS) -> dict:
    """The whole batch of one micro-step (ROWS x SEQ)."""
    g = torch.Generator().manual_seed(1000 + 7 * step + micro)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(ROWS, SEQ, generator=g) < 0.15] = -100
    kind = kinds[(2 * step + micro) % len(kinds)]
    out = {"input_ids": ids, "labels": labels}
    if kind == "padded":
        mask = torch.ones(ROWS, SEQ, dtype=torch.long)
        for r in range(ROWS):
            pad = 3 + 4 * r
            mask[r, :pad] = 0
            ids[r, :pad] = 0
            labels[r, :pad] = -100
        out["attention_mask"] = mask
    elif kind == "packed":
        starts = [(0, 6, 11), (0, 9)]
        pos = torch.zeros(ROWS, SEQ, dtype=torch.long)
        for r, s in enumerate(starts):
            bounds = list(s) + [SEQ]
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                pos[r, a:b] = torch.arange(b - a)
                if a:
                    labels[r, a] = -100
        out["position_ids"] = pos
    return out


def rows(b: dict, share: int, shares: int) -> dict:
    return {k: v.chunk(shares)[share] for k, v in b.items()}


def token_loss(logits: torch.Tensor, shifted: torch.Tensor, count) -> torch.Tensor:
    """Sum of the next-token cross entropies over the labels given (already shifted), divided by ``count``."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                                             ignore_index=-100, reduction="sum") / count


def reference_loss(model, b: dict, shares: int) -> torch.Tensor:
    total = 0
    for s in range(shares):
        part = rows(b, s, shares)
        kw = {k: v for k, v in part.items() if k in ("attention_mask", "position_ids")}
        # no KV cache: with one, transformers skips the packed-sequence (block-diagonal) mask
        logits = model(input_ids=part["input_ids"], use_cache=False, **kw).logits
        target = part["labels"][:, 1:]
        total = total + token_loss(logits[:, :-1], target, (target != -100).sum())
    return total / shares


def reference(family: str, shares: int, accum: int, kinds=KINDS, impl: str = "sdpa"):
    """Single-process training on the whole sequences: (losses, final state dict)."""
    model = BUILDERS[family](impl=impl) if family != "qwen3_moe" else BUILDERS[family]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(accum):
            loss = reference_loss(model, batch(step, micro, kinds), shares) / accum
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(step_loss)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_config(stage: int, sp: int, accum: int, tp: int | None = None, ep: int | None = None,
                  offload: bool = False, recompute: bool = False) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 3000}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    cfg = {"optimizer": {"type": "adamw", "params": {"lr": LR, "weight_decay": WD}}, "zero_optimization": zero,
           "gradient_clipping": CLIP, "gradient_accumulation_steps": accum,
           "sequence_parallel": {"autosp_size": sp, "seq_dim": 1}}
    if recompute:  # the attention runs again in backward, with the mask of the forward it belongs to
        cfg["activation_checkpointing"] = {}
    if tp:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if ep:
        cfg["expert_parallel"] = {"autoep_size": ep}
    return cfg


def sp_loss(engine, b: dict) -> torch.Tensor:
    """This rank's loss: its tokens' cross entropy over the whole sequence group's token count."""
    from polyaccel.sequence import split_batch

    mesh = engine.mesh
    part = split_batch(rows(b, mesh.rank("batch"), mesh.size("batch")), rank=mesh.rank("sequence"),
                       size=mesh.size("sequence"))
    kw = {k: part[k] for k in ("attention_mask", "position_ids") if k in part}
    if mesh.size("tensor") > 1:  # the vocab-parallel loss keeps float64 (transformers' own is float32)
        return engine(input_ids=part["input_ids"], labels=part["labels"], shift_labels=part["shift_labels"],
                      num_items_in_batch=part["num_items_in_batch"], **kw).loss
    return token_loss(engine(input_ids=part["input_ids"], **kw).logits, part["shift_labels"],
                      part["num_items_in_batch"])


def train(family: str, cfg: dict, kinds=KINDS, impl: str = "sdpa") -> dict:
    """10 steps through polyaccel.initialize; the group losses (summed over sequence ranks, averaged over
    batches) and the consolidated parameters."""
    import polyaccel
    from polyaccel import comm

    model = BUILDERS[family](impl=impl) if family != "qwen3_moe" else BUILDERS[family]()
    engine = polyaccel.initialize(model, cfg)
    mesh = engine.mesh
    accum = cfg["gradient_accumulation_steps"]
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(accum):
            loss = sp_loss(engine, batch(step, micro, kinds))
            engine.backward(loss)
            engine.step()
            total += loss.item() / accum
        t = torch.tensor([total], dtype=torch.float64)
        comm.all_reduce(t)  # every rank's share once: sequence ranks add up, batches and tensor copies average
        losses.append(t.item() * mesh.size("sequence") / comm.get_world_size())
    from polyaccel.parallel import get_layout

    params = engine.full_state_dict()
    splits = {n: get_layout(p).split for n, p in engine.module.named_parameters()}
    plan = getattr(engine.module, "autosp_plan", None)
    engine.destroy()
    return {"losses": losses, "params": params, "splits": splits, "plan": plan.describe() if plan is not None else None,
            "coords": {d: mesh.ranks(d) for d in ("sequence", "tensor", "expert", "data", "batch", "expert_data")}}


def assert_matches(got: dict, ref, what: str, tol: float = 1e-10) -> None:
    losses, state = ref
    diff = max(abs(a - b) for a, b in zip(got["losses"], losses, strict=True))
    assert diff <= tol, f"{what}: losses differ by {diff:.3g}\n{got['losses']}\n{losses}"
    def piece(name, full):  # a parameter split over tensor or expert ranks is compared with this rank's piece
        split = got["splits"].get(name)
        return full if split is None else split.piece(full)

    worst = max(((got["params"][k] - piece(k, v)).abs().max().item(), k) for k, v in state.items())
    assert worst[0] <= tol, f"{what}: parameter {worst[1]} differs by {worst[0]:.3g}"


def _muon_testlib():
    """ZeRO's Muon test helpers (config and the op-by-op reference loop), loaded from their file."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "zero" / "muon_testlib.py"
    spec = importlib.util.spec_from_file_location("autosp_muon_testlib", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def muon_config(stage: int, sp: int) -> dict:
    cfg = _muon_testlib().muon_config(stage, micro=1)
    cfg["sequence_parallel"] = {"autosp_size": sp}
    return cfg


def muon_reference(family: str, shares: int, kinds=KINDS):
    """Single-process Muon (matrices) + Adam (the rest) on the whole sequences, as ZeRO's Muon tests check it."""
    from polyaccel.engines.zero.muon import choose_params
    from polyaccel.engines.zero.muon_config import parse_muon

    model = BUILDERS[family]()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    choices = choose_params(model, names, parse_muon({}))
    return _muon_testlib().reference_loop(model, lambda m, step: reference_loss(m, batch(step, 0, kinds), shares),
                                          STEPS, choices)
