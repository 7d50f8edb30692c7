"""AutoSP's activation memory on CPU ranks: what one rank holds for an 8k-token sequence at sp 1 and sp 4.

    python benchmarks/autosp_memory.py [--seq 8192] [--sp 4] [--layers 2] [--hidden 256] [--heads 8]

The measure is the bytes of the tensors autograd saves for backward during the forward (activations,
counted once per storage, parameters excluded), read by a saved-tensors hook: what a rank holds at the
end of the forward, the peak of activation memory before backward starts freeing it. The sp 1 row runs
the plain model in this process; the sp row starts ``sp`` gloo ranks, each running the
``sequence_parallel`` layer on its contiguous part of the same sequence (polyaccel.sequence.split_batch),
and reports the largest rank. Both rows then run backward, so the split run is a real training step.
Target (issue 47): sp 4 at most 0.35x of sp 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(args):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads, max_position_embeddings=args.seq,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class SavedBytes:
    """Bytes of distinct non-parameter storages autograd saved while entered."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.params:
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def batch(args):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def step(model, part) -> tuple[int, float, float]:
    """(saved bytes, loss, seconds) of one forward and backward on ``part``."""
    kw = {k: part[k] for k in ("position_ids",) if k in part}
    start = time.perf_counter()
    with SavedBytes(model) as saved:
        logits = model(input_ids=part["input_ids"], **kw).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), part["shift_labels"].reshape(-1),
                                                 reduction="sum") / part["num_items_in_batch"]
    loss.backward()
    return saved.total, loss.item(), time.perf_counter() - start


def split_rank(rank: int, world: int, args) -> tuple[int, float, float]:
    from polyaccel.comm.mesh import init_parallel_mesh
    from polyaccel.engines.autosp import apply_sequence_parallel
    from polyaccel.sequence import split_batch

    torch.set_num_threads(1)
    mesh = init_parallel_mesh(sequence=world)
    model = apply_sequence_parallel(build(args), {"autosp_size": world}, mesh)
    return step(model, split_batch(batch(args), rank=rank, size=world))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--sp", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from polyaccel.sequence import split_batch
    from polyaccel.testing.multiprocess import run_ranks

    base, base_loss, base_s = step(build(args), split_batch(batch(args), rank=0, size=1))
    ranks = run_ranks(split_rank, args.sp, args, timeout=1800)
    peak = max(r[0] for r in ranks)
    loss = sum(r[1] for r in ranks)
    ratio = peak / base
    mib = 1 << 20
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}; "
          f"one sequence of {args.seq} tokens, float32, sdpa")
    print(f"sp 1: {base / mib:8.1f} MiB saved for backward   loss {base_loss:.6f}   {base_s:.1f} s")
    print(f"sp {args.sp}: {peak / mib:8.1f} MiB on the largest rank "
          f"(ranks: {', '.join(f'{r[0] / mib:.1f}' for r in ranks)})   loss summed over ranks {loss:.6f}")
    print(f"ratio sp {args.sp} / sp 1: {ratio:.3f}x (target <= 0.35x)   loss difference {abs(loss - base_loss):.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seq": args.seq, "sp": args.sp, "sp1_bytes": base, "sp_bytes": [r[0] for r in ranks],
                       "ratio": ratio, "loss_sp1": base_loss, "loss_sp": loss}, f, indent=1)


if __name__ == "__main__":
    main()
