"""Stage 3 per-rank memory by element counts, at world sizes 1 and N (CPU, gloo).

    python benchmarks/zero_stage3_elements.py [--world 2] [--offload]

For each world size: per rank, the parameter elements resident between steps (shards, and the
parameters at or below ``stage3_param_persistence_threshold``, which every rank keeps whole), the fp32
master partition, the optimizer state and the gradient partition (after a
backward), each as a fraction of the model's parameter count; ideal is 1/N for each. Counts, not
bytes: multiply by the element sizes (2 for bf16 parameters, 4 for fp32 master and state).
"""

from __future__ import annotations

import argparse

import torch


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def worker(rank: int, world: int, offload: bool) -> dict:
    import polyaccel

    zero = {"stage": 3, "reduce_bucket_size": 500_000, "stage3_prefetch_bucket_size": 500_000}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    engine = polyaccel.initialize(_model(), {"zero_optimization": zero,
                                             "optimizer": {"type": "adamw", "params": {"lr": 1e-3}}})
    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    grad = engine.partitioner.grad.numel()
    engine.step()
    # shards and gathered parameters; at world size 1 a parameter is its shard (one storage), and in this fp32
    # run a parameter cast from the master is the master itself (counted under "master")
    master_storage = engine.partitioner.master.untyped_storage().data_ptr()
    storages = {master_storage: 0}
    for info in engine.partitioner.infos.values():
        for t in (info.param.data, info.shard):  # a trainable shard is not stored while the master is on the device
            if t is not None and t.numel() and t.untyped_storage().data_ptr() != master_storage:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
    out = {"params": sum(storages.values()), "master": engine.partitioner.master.numel(),
           "state": engine.optimizer.state_elements(), "grad": grad}
    engine.destroy()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--offload", action="store_true", help="offload the optimizer (master and state on the host)")
    args = ap.parse_args()
    from polyaccel.testing.multiprocess import run_ranks

    total = sum(p.numel() for p in _model().parameters())
    print(f"Llama 4 x 256, {total:,} parameters; stage 3, AdamW{' (optimizer offloaded)' if args.offload else ''}")
    print(f"{'world':>5s} {'rank':>4s} " + " ".join(f"{k + ' / total':>16s}" for k in ("params", "master", "state",
                                                                                        "grad")))
    for world in sorted({1, args.world}):
        for rank, got in enumerate(run_ranks(worker, world, args.offload, timeout=300)):
            print(f"{world:5d} {rank:4d} " + " ".join(f"{got[k] / total:16.4f}" for k in ("params", "master",
                                                                                       "state", "grad")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
