"""Profile a few ZeRO steps (world size 1) and print where host and device time go.

    python benchmarks/zero_profile.py [--stage 3] [--offload [--offload-param]] [--muon] [--granularity N]
                                      [--size 220m] [--rows 30] [--kernels]

Also printed: a step's wall time and the GPU's kernel time in it (busy below ~90%: the host sets the pace).
"""

from __future__ import annotations

import argparse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--offload-param", action="store_true", help="with --offload at stage 3: offload_param too")
    ap.add_argument("--muon", action="store_true", help="optimizer.type muon (zero_gpu.py's MUON_PARAMS)")
    ap.add_argument("--granularity", type=int, default=0, help="stage3_module_granularity_threshold")
    ap.add_argument("--size", default="220m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--trace", default=None, help="write a Chrome trace here")
    ap.add_argument("--kernels", action="store_true", help="with the model kernels (zero_kernels.KERNELS)")
    args = ap.parse_args()

    import polyaccel
    from torch.profiler import ProfilerActivity, profile
    from zero_gpu import MUON_PARAMS, SIZES, batches, build

    for key, value in SIZES[args.size].items():
        setattr(args, key, value)
    zero = {"stage": args.stage, "reduce_bucket_size": 50_000_000}
    if args.granularity:
        zero["stage3_module_granularity_threshold"] = args.granularity
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if args.offload_param:
            zero["offload_param"] = {"device": "cpu"}
    optimizer = {"type": "muon", "params": MUON_PARAMS} if args.muon else {"type": "adamw", "params": {"lr": 1e-4}}
    config = {"bf16": {"enabled": True}, "zero_optimization": zero, "optimizer": optimizer}
    if args.kernels:
        from zero_kernels import KERNELS

        config["kernels"] = dict(KERNELS)
    engine = polyaccel.initialize(build(args), config)
    acc = polyaccel.get_accelerator()
    data = [ids.to(acc.device()) for ids in batches(args, 5)]

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    for ids in data[:3]:
        step(ids)
    acc.synchronize()
    print(phase_times(engine, acc, data))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if acc.device().type == "cuda" else [])
    import time

    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for ids in data[3:]:
            step(ids)
        acc.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / len(data[3:])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if acc.device().type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
    if acc.device().type == "cuda":
        import torch

        busy = sum(e.self_device_time_total for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3 / len(data[3:])
        print(f"a step: {wall_ms:.1f} ms wall (under the profiler), GPU kernels {busy:.1f} ms "
              f"({busy / wall_ms:.0%} busy)")
    if args.trace:
        prof.export_chrome_trace(args.trace)
    engine.destroy()
    return 0


def phase_times(engine, acc, data) -> str:
    """Forward, backward and optimizer step timed apart (synchronised between them, no profiler): the
    optimizer's share of a step, host work included, for comparing optimizers. Beside each phase: the host's
    share (until the phase's calls return, before the wait), the time in Python's garbage collector and the
    device allocator's fresh allocations, retries and whole-device syncs during it (a phase slower after one
    optimizer than after another with the same kernels is slowed by one of these)."""
    import gc
    import statistics
    import time

    from polyaccel.errors import Unsupported

    gc_ms = [0.0]
    started = [0.0]

    def on_gc(phase, _info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gc_ms[0] += (time.perf_counter() - started[0]) * 1e3

    keys = ("num_device_alloc", "num_alloc_retries", "num_sync_all_streams")

    def counters():
        try:
            stats = acc.memory_stats()
        except Unsupported:  # a plugin without memory statistics
            return dict.fromkeys(keys, 0)
        return {k: stats.get(k, 0) for k in keys}

    rows: dict[str, dict[str, list[float]]] = {}
    phases = {
        "forward": lambda ids, _: engine(input_ids=ids, labels=ids).loss,
        "backward": lambda _, loss: engine.backward(loss),
        "step": lambda _, __: engine.step(),
    }
    gc.callbacks.append(on_gc)
    try:
        for ids in data:
            loss = None
            for name, run in phases.items():
                acc.synchronize()
                before, gc_ms[0] = counters(), 0.0
                t0 = time.perf_counter()
                out = run(ids, loss)
                t1 = time.perf_counter()
                acc.synchronize()
                t2 = time.perf_counter()
                loss = out if name == "forward" else loss
                after = counters()
                row = rows.setdefault(name, {})
                for key, value in (("ms", (t2 - t0) * 1e3), ("host ms", (t1 - t0) * 1e3), ("gc ms", gc_ms[0]),
                                   *((k, after[k] - before[k]) for k in keys)):
                    row.setdefault(key, []).append(value)
    finally:
        gc.callbacks.remove(on_gc)
    return "phases (median, synchronised apart):\n" + "\n".join(
        f"  {name:8s} " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in row.items())
        for name, row in rows.items())


if __name__ == "__main__":
    raise SystemExit(main())
