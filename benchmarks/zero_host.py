"""Where a ZeRO step's host time goes at world size 1: synchronising calls, launches, Python.

    python benchmarks/zero_host.py [--stage 3] [--size 220m] [--offload] [--steps 4] [--rows 25]

Per step it prints the host time until ``engine.step()`` returns (nothing synchronised inside the
step) and the time until the device is done; the runtime calls by count (launches, copies,
synchronisations: every ``cudaStreamSynchronize`` stops the host from running ahead of the device);
and each synchronising call site (``torch.cuda.set_sync_debug_mode``'s warnings, grouped by the
stack within polyaccel) with how often it ran per step. Then the Python functions by own time
(cProfile) over the same steps. Runs on the cpu plugin too (no device rows there).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import time
import traceback
import warnings


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--size", default="220m")
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--trace", default=None, help="write the profiled steps' Chrome trace here (.json.gz) and print "
                                                  "where the device sat idle, and what the host ran meanwhile")
    args = ap.parse_args()

    import polyaccel
    import torch
    from zero_gpu import SIZES, batches, build

    for key, value in SIZES[args.size].items():
        setattr(args, key, value)
    zero = {"stage": args.stage, "reduce_bucket_size": 50_000_000}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    engine = polyaccel.initialize(build(args), {"bf16": {"enabled": True}, "zero_optimization": zero,
                                                "optimizer": {"type": "adamw", "params": {"lr": 1e-4}}})
    acc = polyaccel.get_accelerator()
    cuda = acc.device().type == "cuda"
    data = [ids.to(acc.device()) for ids in batches(args, 3 + 3 * args.steps)]

    from torch.profiler import record_function

    def step(ids):
        with record_function("phase:forward"):
            loss = engine(input_ids=ids, labels=ids).loss
        with record_function("phase:backward"):
            engine.backward(loss)
        with record_function("phase:step"):
            engine.step()

    for ids in data[:3]:
        step(ids)
    acc.synchronize()

    # 1. host time vs device time per step
    host, full = [], []
    for ids in data[3:3 + args.steps]:
        t0 = time.perf_counter()
        step(ids)
        t1 = time.perf_counter()
        acc.synchronize()
        host.append((t1 - t0) * 1e3)
        full.append((time.perf_counter() - t0) * 1e3)
    print(f"stage {args.stage} {args.size}{' offload' if args.offload else ''}: host until step() returns "
          f"{sorted(host)[len(host) // 2]:.1f} ms, until the device is done {sorted(full)[len(full) // 2]:.1f} ms")

    # 2. runtime calls and device time by the profiler
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for ids in data[3 + args.steps:3 + 2 * args.steps]:
                step(ids)
            acc.synchronize()
        calls = collections.Counter()
        for e in prof.key_averages():
            if e.key.startswith("cu"):  # runtime and driver calls
                calls[e.key] += e.count
        print("runtime calls per step:", ", ".join(f"{k} {v / args.steps:.0f}" for k, v in calls.most_common(8)))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
        if args.trace:
            prof.export_chrome_trace(args.trace)
            idle_report(args.trace, args.steps)

        # 3. synchronising call sites
        sites = collections.Counter()

        def on_warning(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-1] if "polyaccel" in f.filename or "engines" in f.filename]
            where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))
            sites[f"{str(message)[:60]} @ {where or filename + ':' + str(lineno)}"] += 1

        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():  # (restores showwarning too)
            warnings.simplefilter("always")
            warnings.showwarning = on_warning
            for ids in data[3 + args.steps:3 + 2 * args.steps]:
                step(ids)
        torch.cuda.set_sync_debug_mode(0)
        print("synchronising call sites (per step):")
        for site, n in sites.most_common(20):
            print(f"  {n / args.steps:5.1f}  {site}")

    # 4. Python time
    pr = cProfile.Profile()
    pr.enable()
    for ids in data[3 + 2 * args.steps:]:
        step(ids)
    acc.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(args.rows)
    engine.destroy()
    return 0


def idle_report(path: str, steps: int, rows: int = 15) -> None:
    """From a Chrome trace: the device's busy and idle time, the idle time by the phase the host was in when
    each gap began, and the longest gaps with the innermost host operation running at their start."""
    import gzip
    import json

    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    device = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    if not device:
        return
    busy, gaps, end = 0.0, [], device[0][0]
    for lo, hi in device:
        if lo > end:
            gaps.append((end, lo))
        busy += max(0.0, hi - max(lo, end))
        end = max(end, hi)
    span = end - device[0][0]

    def running(t):
        ops = [e for e in host if e["ts"] <= t < e["ts"] + e["dur"]]
        phase = next((e["name"] for e in ops if e["name"].startswith("phase:")), "-")
        inner = min((e for e in ops if not e["name"].startswith("phase:")), key=lambda e: e["dur"], default=None)
        return phase, inner["name"] if inner else "-"

    phases = [e for e in host if e["name"].startswith("phase:")]
    by_phase = collections.Counter()
    for lo, hi in gaps:
        by_phase[next((e["name"] for e in phases if e["ts"] <= lo < e["ts"] + e["dur"]), "-")] += hi - lo
    print(f"device busy {busy / 1e3 / steps:.1f} ms per step of a {span / 1e3 / steps:.1f} ms span; idle by the "
          "host's phase at the gap's start: " + ", ".join(f"{k} {v / 1e3 / steps:.1f} ms" for k, v in by_phase.items()))
    print("longest idle gaps (us, host phase, innermost host op):")
    for lo, hi in sorted(gaps, key=lambda g: g[0] - g[1])[:rows]:
        phase, op = running(lo)
        print(f"  {hi - lo:8.0f}  {phase:16s} {op}")


if __name__ == "__main__":
    raise SystemExit(main())
