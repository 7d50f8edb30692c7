"""AutoTP on one device: what the tensor_parallel layer costs at tp 1, and the vocab-parallel loss.

    python benchmarks/autotp_gpu.py [--layers 12 --hidden 1024 --batch 8 --seq 1024 --steps 20]
                                    [--tokens 8192 --vocab 128256] [--out results.json]
    python benchmarks/autotp_gpu.py --quick          # small sizes, runs on the CPU too

Measured in one process on the selected polyaccel accelerator (its memory statistics where it
keeps them):

1. A Hugging Face Llama trained with torch's fused AdamW under bf16 autocast, as is ("HF") and
   after AutoTP at ``autotp_size`` 1 ("AutoTP tp=1"); then the same two through
   ``polyaccel.initialize`` with ZeRO stage 1, without and with a ``tensor_parallel`` section.
   Same initial weights and batches; step time is the median over ``--steps`` steps after
   warm-up, the runs interleaved (A B B A ...) so drift hits both. Target (issue): within 2%.
2. The vocab-parallel cross-entropy against ``F.cross_entropy`` on the full logits
   (``[tokens, vocab]`` bf16 logits, upcast to fp32 as transformers' loss does), forward +
   backward: time and peak memory above the logits. At tp 1 the loss holds the whole
   vocabulary; the "tp=k shard" rows run it on the ``vocab/k`` columns one rank of k holds
   (collectives over a group of one: the per-rank cost, not a k-device run).

Where the accelerator keeps no memory statistics (the CPU), the memory columns count the
elements the measured code allocates (a dispatch-mode count; views and in-place results excluded).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import socket
import statistics
import time

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, args.hidden // 64)
    cfg = LlamaConfig(vocab_size=args.model_vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=args.seq, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


class _Allocated:
    """Elements allocated by ops inside the block (a memory proxy where the device keeps no statistics)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        counter = self
        self.elements = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                        if isinstance(t, torch.Tensor) and t.numel()}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in seen:
                        counter.elements += t.numel() * t.element_size()
                return out

        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def peak_above(fn, acc) -> tuple[int, str]:
    """(bytes, how): the peak above what was allocated before ``fn``, or the bytes ops allocated in it."""
    if acc.has("memory_stats"):
        gc.collect()
        acc.empty_cache()
        acc.synchronize()
        acc.reset_peak_memory_stats()
        base = acc.memory_allocated()
        fn()
        acc.synchronize()
        return acc.max_memory_allocated() - base, "peak"
    with _Allocated() as a:
        fn()
    return a.elements, "allocated"


# ------------------------------------------------------------------------------------------- part 1
def bench_models(args, acc, device) -> list[dict]:
    import polyaccel
    from polyaccel.engines.autotp import apply_tensor_parallel

    base = build(args)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, args.model_vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps + 3)]
    cast = torch.bfloat16 if acc.is_bf16_supported() and device.type != "cpu" else None

    def torch_runner(model):
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                fused=device.type != "cpu" or None)

        def step(ids):
            with torch.autocast(device.type, dtype=cast, enabled=cast is not None):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        return step, model

    def engine_runner(model, tp_section):
        cfg = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "adamw", "params": {"lr": 1e-4}}}
        if cast is not None:
            cfg["bf16"] = {"enabled": True}
        if tp_section:
            cfg["tensor_parallel"] = {"autotp_size": 1}
        engine = polyaccel.initialize(model.to(device), cfg)

        def step(ids):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss.detach()
        return step, engine

    rows = []
    pairs = [
        ("HF model + torch AdamW", lambda: torch_runner(copy.deepcopy(base)),
         "AutoTP tp=1 + torch AdamW",
         lambda: torch_runner(apply_tensor_parallel(copy.deepcopy(base), {"autotp_size": 1}, group=None, rank=0,
                                                    tp=1))),
        ("ZeRO-1 (no tensor_parallel)", lambda: engine_runner(copy.deepcopy(base), False),
         "ZeRO-1 + tensor_parallel autotp_size 1", lambda: engine_runner(copy.deepcopy(base), True)),
    ]
    for name_a, make_a, name_b, make_b in pairs:
        runners = {}
        for name, make in ((name_a, make_a), (name_b, make_b)):
            step, owner = make()
            for ids in data[:3]:  # warm-up
                step(ids.to(device))
            acc.synchronize()
            runners[name] = (step, owner)
        times = {name_a: [], name_b: []}
        losses = {name_a: [], name_b: []}
        for i, ids in enumerate(data[3:]):
            ids = ids.to(device)
            for name in ((name_a, name_b) if i % 2 == 0 else (name_b, name_a)):
                acc.synchronize()
                t0 = time.perf_counter()
                losses[name].append(float(runners[name][0](ids)))
                acc.synchronize()
                times[name].append(time.perf_counter() - t0)
        peaks = {}
        for name in (name_a, name_b):
            peaks[name] = peak_above(lambda step=runners[name][0]: step(data[0].to(device)), acc)
        for name in (name_a, name_b):
            owner = runners[name][1]
            if hasattr(owner, "destroy"):
                owner.destroy()
        runners.clear()
        gc.collect()
        acc.empty_cache()
        ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        rows.append({"case": f"{name_b} vs {name_a}", "baseline": name_a, "baseline_step_ms": ms[name_a],
                     "ours_step_ms": ms[name_b], "time_ratio": ms[name_b] / ms[name_a],
                     "baseline_peak_bytes": peaks[name_a][0], "ours_peak_bytes": peaks[name_b][0],
                     "memory_ratio": peaks[name_b][0] / peaks[name_a][0] if peaks[name_a][0] else None,
                     "memory_measure": peaks[name_a][1],
                     "same_losses": losses[name_a] == losses[name_b],
                     "last_loss": (losses[name_a][-1], losses[name_b][-1])})
    return rows


# ------------------------------------------------------------------------------------------- part 2
def bench_loss(args, acc, device) -> list[dict]:
    from polyaccel.engines.autotp import vocab_parallel_cross_entropy
    from polyaccel.engines.autotp.shard import shard_sizes

    n, vocab = args.tokens, args.vocab
    g = torch.Generator(device="cpu").manual_seed(3)
    dtype = torch.bfloat16 if acc.is_bf16_supported() and device.type != "cpu" else torch.float32
    full = (torch.randn(n, vocab, generator=g) * 2).to(device=device, dtype=dtype)
    target = torch.randint(0, vocab, (n,), generator=g).to(device)

    def baseline():
        x = full.detach().requires_grad_()
        loss = torch.nn.functional.cross_entropy(x.float(), target)
        loss.backward()
        return loss

    def ours(cols):
        def fn():
            x = full[:, :cols].detach().requires_grad_()
            loss = vocab_parallel_cross_entropy(x, target.clamp(max=cols - 1), group=None, vocab_start=0)
            loss.backward()
            return loss
        return fn

    def median_ms(fn):
        for _ in range(2):
            fn()
        acc.synchronize()
        ts = []
        for _ in range(args.loss_steps):
            acc.synchronize()
            t0 = time.perf_counter()
            fn()
            acc.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    base_ms = median_ms(baseline)
    base_mem, how = peak_above(baseline, acc)
    check = abs(ours(vocab)().item() - baseline().item())
    rows = [{"case": f"F.cross_entropy(logits.float()) [{n} x {vocab}] {str(dtype).replace('torch.', '')}",
             "ms": base_ms, "bytes": base_mem, "memory_measure": how}]
    for tp in (1, 2, 4, 8):
        cols = shard_sizes(vocab, tp)[0]
        ms = median_ms(ours(cols))
        mem, _ = peak_above(ours(cols), acc)
        label = "vocab-parallel CE, tp=1 (whole vocabulary)" if tp == 1 else f"vocab-parallel CE, tp={tp} shard"
        rows.append({"case": f"{label} [{n} x {cols}]", "ms": ms, "bytes": mem, "memory_measure": how,
                     "time_ratio": ms / base_ms, "memory_ratio": mem / base_mem if base_mem else None,
                     "tp": tp, **({"abs_loss_diff_vs_baseline": check} if tp == 1 else {})})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--model-vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--loss-steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU-friendly)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.hidden, args.batch, args.seq, args.model_vocab = 2, 128, 2, 64, 1000
        args.steps, args.tokens, args.vocab, args.loss_steps = 12, 256, 8000, 3

    import polyaccel
    from polyaccel import comm

    acc = polyaccel.get_accelerator()
    device = acc.device()
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared host: OpenMP threads waiting on busy cores make the timings noise
    if not comm.is_initialized():
        comm.init_distributed(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    name = acc.device_name() if hasattr(acc, "device_name") else str(device)
    print(f"accelerator {acc.name} ({device}); torch {torch.__version__}", flush=True)

    models = bench_models(args, acc, device)
    print(f"\n1. Llama {args.layers}x{args.hidden}, batch {args.batch}x{args.seq}: step time and memory "
          f"({models[0]['memory_measure']})")
    print(f"{'':45s} {'base ms':>9s} {'ours ms':>9s} {'ratio':>7s} {'base MiB':>10s} {'ours MiB':>10s} {'ratio':>7s}")
    for r in models:
        mr = f"{r['memory_ratio']:.3f}" if r["memory_ratio"] else "-"
        print(f"{r['case'][:45]:45s} {r['baseline_step_ms']:9.2f} {r['ours_step_ms']:9.2f} {r['time_ratio']:7.3f} "
              f"{r['baseline_peak_bytes'] / 2**20:10.1f} {r['ours_peak_bytes'] / 2**20:10.1f} {mr:>7s}"
              f"  same losses: {r['same_losses']}")

    losses = bench_loss(args, acc, device)
    print(f"\n2. cross-entropy over {args.tokens} tokens x {args.vocab} vocabulary, forward + backward "
          f"({losses[0]['memory_measure']} bytes above the logits)")
    print(f"{'':60s} {'ms':>9s} {'x base':>7s} {'MiB':>10s} {'x base':>7s}")
    for r in losses:
        tr = f"{r['time_ratio']:.3f}" if "time_ratio" in r else "-"
        mr = f"{r['memory_ratio']:.3f}" if r.get("memory_ratio") else "-"
        print(f"{r['case'][:60]:60s} {r['ms']:9.2f} {tr:>7s} {r['bytes'] / 2**20:10.1f} {mr:>7s}")
    print(f"   |loss(vocab-parallel, tp=1) - loss(F.cross_entropy)| = {losses[1]['abs_loss_diff_vs_baseline']:.3g}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "args": vars(args), "models": models, "loss": losses}, f, indent=1)
    comm.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
