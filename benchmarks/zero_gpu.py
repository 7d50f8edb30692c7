"""ZeRO engine on one GPU (world size 1): step time and peak memory per stage, with and without offload.

World size 1 shows the engine's own overhead (flat buffers, buckets, hooks, host copies) and what
offload saves; it cannot show communication savings. Baseline in the same process: plain torch
``AdamW(fused=True)`` on an fp32 model under bf16 autocast (the usual mixed-precision recipe,
16 bytes of state per parameter like ZeRO at world size 1).

    python benchmarks/zero_gpu.py [--layers 12 --hidden 1024 --batch 8 --seq 1024 --steps 10] [--out x.json]

Every configuration starts from the same initial weights and sees the same batches, so the first
loss must agree across rows and the last losses should be close (bf16).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time

import torch

CONFIGS = [
    ("stage 1", {"stage": 1}),
    ("stage 1 + offload_optimizer", {"stage": 1, "offload_optimizer": {"device": "cpu"}}),
    ("stage 2", {"stage": 2}),
    ("stage 2 + offload_optimizer", {"stage": 2, "offload_optimizer": {"device": "cpu"}}),
    ("stage 3", {"stage": 3}),
    ("stage 3 + offload_optimizer", {"stage": 3, "offload_optimizer": {"device": "cpu"}}),
    ("stage 3 + offload_optimizer + offload_param",
     {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
]


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=args.hidden // 64, max_position_embeddings=args.seq,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def batches(args, n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32000, (args.batch, args.seq), generator=g) for _ in range(n)]


def run(step_fn, data, device, sync):
    times, losses = [], []
    for i, ids in enumerate(data):
        ids = ids.to(device, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        loss = step_fn(ids)
        sync()
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return times, losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bucket", type=int, default=50_000_000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import polyaccel

    acc = polyaccel.get_accelerator()
    device = acc.device()
    sync = acc.synchronize
    has_mem = acc.has("memory_stats")
    reset_peak = acc.reset_peak_memory_stats if has_mem else (lambda: None)
    peak_now = acc.max_memory_allocated if has_mem else (lambda: 0)
    base_model = build(args)
    n_params = sum(p.numel() for p in base_model.parameters())
    data = batches(args, args.steps + 3)
    tokens = args.batch * args.seq
    rows = []

    def record(name, times, losses, peak, extra=None):
        med = statistics.median(times)
        row = {"config": name, "step_ms": med * 1e3, "tokens_per_s": tokens / med, "peak_gib": peak / 2**30,
               "bytes_per_param": peak / n_params, "first_loss": losses[0], "last_loss": losses[-1], **(extra or {})}
        rows.append(row)
        if args.out:  # after every row, so a run cut short still leaves its numbers
            with open(args.out, "w") as f:
                json.dump({"params": n_params, "args": vars(args), "rows": rows}, f, indent=1)
        print(f"{name:45s} {row['step_ms']:9.1f} ms {row['tokens_per_s']:10.0f} tok/s {row['peak_gib']:7.2f} GiB "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f} {extra or ''}", flush=True)

    # baseline: fp32 weights, bf16 autocast, torch's fused AdamW
    model = copy.deepcopy(base_model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    reset_peak()

    def torch_step(ids):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    times, losses = run(torch_step, data, device, sync)
    record("torch AdamW(fused) fp32 + bf16 autocast", times, losses, peak_now())
    model = opt = None  # free the baseline before the engines run
    gc.collect()
    acc.empty_cache()

    for name, zero in CONFIGS:
        zero = {"reduce_bucket_size": args.bucket, **zero}
        config = {"bf16": {"enabled": True}, "zero_optimization": zero,
                  "optimizer": {"type": "adamw", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
        try:
            engine = polyaccel.initialize(copy.deepcopy(base_model), config)
            reset_peak()

            def zero_step(ids, engine=engine):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                return loss.detach()

            times, losses = run(zero_step, data, device, sync)
            record(name, times, losses, peak_now(),
                   {"optimizer_builder": engine.optimizer_builder,
                    "resident_param_elements": engine.partitioner.device_param_elements()})
            engine.destroy()
            del engine
        except Exception as exc:  # noqa: BLE001 - record the failure, go on with the other rows
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            rows.append({"config": name, "error": f"{type(exc).__name__}: {exc}"})
        gc.collect()
        acc.empty_cache()

    base = rows[0]
    print(f"\nmodel: Llama {args.layers}x{args.hidden}, {n_params / 1e6:.1f} M params, batch {args.batch}x{args.seq}, "
          f"device {torch.cuda.get_device_name() if device.type == 'cuda' else device}")
    print(f"{'config':45s} {'step ms':>9s} {'vs torch':>9s} {'peak GiB':>9s} {'B/param':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:45s} FAILED: {r['error']}")
            continue
        print(f"{r['config']:45s} {r['step_ms']:9.1f} {base['step_ms'] / r['step_ms']:9.2f} {r['peak_gib']:9.2f} "
              f"{r['bytes_per_param']:8.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"params": n_params, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
