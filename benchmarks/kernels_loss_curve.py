"""The loss curve with the model kernels against without (issue 46: "a 200-step loss curve with kernels equal to
the one without within bf16 noise"). Not a test: 600 training steps.

Three runs in one process, from the same initial weights on the same batches (the bundled text, bytes as tokens,
``polyaccel train``'s Llama), through ``polyaccel.initialize`` (ZeRO stage 2, AdamW):

- ``bf16``: bf16 training, Hugging Face's modules;
- ``bf16 + kernels``: the same with ``"kernels"`` all on (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy);
- ``fp32``: float32 training, Hugging Face's modules: the yardstick for bf16 noise.

The kernels' curve is within bf16 noise when its distance from the bf16 curve is no larger than the bf16
curve's own distance from float32 (both: the mean |difference| over the last 50 steps, and the largest).

    python benchmarks/kernels_loss_curve.py [--steps 200] [--hidden 256] [--layers 4] [--batch 8] [--seq 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def train(args, dtype: str, kernels: bool) -> list[float]:
    import polyaccel
    from polyaccel.apps.train.data import ByteTokenizer, TokenSampler, load_text
    from polyaccel.apps.train.model import ModelSpec, build_model

    torch.manual_seed(args.seed)
    spec = ModelSpec(name="llama", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
                     max_positions=max(256, args.seq))
    model = build_model(spec)
    cfg = {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": args.batch,
           "optimizer": {"type": "adamw", "params": {"lr": args.lr, "weight_decay": 0.0}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if kernels:
        cfg["kernels"] = {"rms_norm": True, "rope": True, "swiglu": True, "cross_entropy": True}
    engine = polyaccel.initialize(model, cfg)
    device = engine.device
    sampler = TokenSampler(ByteTokenizer().encode(load_text(None)), args.seq, args.batch, args.seed)
    losses = []
    try:
        engine.train()
        for step in range(args.steps):
            b = sampler.batch(step, 0, 0, 1)
            out = engine(input_ids=b.input_ids.to(device), labels=b.labels.to(device))
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
    finally:
        engine.destroy()
    return losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import polyaccel
    import transformers

    transformers.logging.set_verbosity_error()
    print(f"device: {polyaccel.get_accelerator().device_type}; Llama {args.layers}x{args.hidden}, batch "
          f"{args.batch}x{args.seq}, {args.steps} steps", flush=True)
    curves, times = {}, {}
    for name, dtype, kernels in (("bf16", "bf16", False), ("bf16 + kernels", "bf16", True), ("fp32", "fp32", False)):
        t0 = time.perf_counter()
        curves[name] = train(args, dtype, kernels)
        times[name] = time.perf_counter() - t0
        print(f"{name}: {times[name]:.1f} s, loss {curves[name][0]:.4f} -> {curves[name][-1]:.4f}", flush=True)
    n = len(curves["bf16"])
    marks = sorted({0, n // 4, n // 2, 3 * n // 4, n - 1})
    print(f"{'step':>6s} " + " ".join(f"{k:>15s}" for k in curves))
    for i in marks:
        print(f"{i + 1:6d} " + " ".join(f"{c[i]:15.4f}" for c in curves.values()))
    tail = slice(max(0, n - 50), n)

    def distance(a, b):
        diffs = [abs(x - y) for x, y in zip(curves[a][tail], curves[b][tail], strict=True)]
        worst = max(abs(x - y) for x, y in zip(curves[a], curves[b], strict=True))
        return statistics.mean(diffs), worst

    k_mean, k_max = distance("bf16 + kernels", "bf16")
    n_mean, n_max = distance("bf16", "fp32")
    print(f"\n|bf16 + kernels - bf16|: last-50 mean {k_mean:.4f}, largest {k_max:.4f}")
    print(f"|bf16 - fp32| (noise):   last-50 mean {n_mean:.4f}, largest {n_max:.4f}")
    verdict = "within" if k_mean <= n_mean and k_max <= max(n_max, 1e-9) else "NOT within"
    print(f"the kernels' curve is {verdict} bf16 noise")
    print("wall s: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
