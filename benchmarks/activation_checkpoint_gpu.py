"""Activation checkpointing on one GPU: memory saved and time paid, with and without host-kept inputs.

    python benchmarks/activation_checkpoint_gpu.py [--size 220m --batch 16 --seq 1024 --steps 5] [--out x.json]

ZeRO stage 2 (bf16) on the Llama of ``zero_gpu.py``, four rows in one process: no checkpointing,
Hugging Face's own checkpointing (``torch.utils.checkpoint``, non-reentrant), the engine's
``activation_checkpointing`` section, and the same with ``cpu_checkpointing`` (each decoder
layer's input kept in pinned host memory). Same weights and batches; the losses must agree.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="220m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import polyaccel
    from zero_gpu import SIZES, batches, build, run

    for key, value in SIZES[args.size].items():
        setattr(args, key, value)
    acc = polyaccel.get_accelerator()
    device = acc.device()
    base = build(args)
    data = batches(args, args.steps + 3)
    rows = []
    for name, section, hf in (("no checkpointing", None, False), ("torch.utils.checkpoint (HF switch)", None, True),
                              ("polyaccel activation_checkpointing", {}, False),
                              ("polyaccel cpu_checkpointing", {"cpu_checkpointing": True}, False)):
        model = copy.deepcopy(base)
        model.train()
        if hf:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000},
                  "optimizer": {"type": "adamw", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
        if section is not None:
            config["activation_checkpointing"] = section
        engine = polyaccel.initialize(model, config)
        acc.reset_peak_memory_stats()

        def step(ids, engine=engine):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss.detach()

        times, losses = run(step, data, device, acc.synchronize)
        row = {"config": name, "step_ms": statistics.median(times) * 1e3,
               "peak_gib": acc.max_memory_allocated() / 2**30, "first_loss": losses[0], "last_loss": losses[-1]}
        rows.append(row)
        print(f"{name:40s} {row['step_ms']:8.1f} ms {row['peak_gib']:7.2f} GiB "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        engine.destroy()
        del engine, model
        gc.collect()
        acc.empty_cache()
    base_row = rows[0]
    print(f"\nLlama {args.layers}x{args.hidden}, batch {args.batch}x{args.seq}")
    for r in rows:
        print(f"{r['config']:40s} time x{r['step_ms'] / base_row['step_ms']:5.2f}  "
              f"peak x{r['peak_gib'] / base_row['peak_gib']:5.2f}  "
              f"({base_row['peak_gib'] - r['peak_gib']:.2f} GiB saved)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
