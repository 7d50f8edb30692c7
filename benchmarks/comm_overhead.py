"""polyaccel.comm.all_reduce vs raw torch.distributed.all_reduce on small tensors (gloo, 2 ranks, one run).

    python benchmarks/comm_overhead.py [--iters 200] [--rounds 51] [--sizes 1,256,4096]

Both ranks run the same schedule: for each tensor size, ``rounds`` rounds of alternating
blocks (raw torch, polyaccel, polyaccel with a CommTracer entered), ``iters`` calls per
block, the ranks aligned by a barrier before every block. The time per call of a block is
its wall time / iters; a variant's figure is the median over rounds. Printed ratios are
polyaccel / raw (target: under 1.05 for the untraced path); the headline is the median of
the per-round ratios of adjacent blocks, which cancels slow drifts in machine load. On a
shared, loaded machine use many short rounds (the defaults) rather than a few long ones.

A second section times single calls, raw and polyaccel alternating call by call, and
compares the median (and lower quartile) latencies: scheduler spikes on a loaded machine
land in the tail, not in these. A third section measures the layer's own cost with the transport taken out: in one
process, ``torch.distributed.all_reduce`` is replaced by a no-op, and the time per call of
``polyaccel.comm.all_reduce`` around it is compared with calling the no-op directly.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _block(call, tensor, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call(tensor)
    return (time.perf_counter() - start) / iters


def interleaved(tensor, pairs: int) -> tuple[float, float, float, float]:
    """Median and lower-quartile latency of single calls, raw and polyaccel alternating call by call."""
    from polyaccel import comm

    clock = time.perf_counter_ns
    raw, ours = [], []
    dist.barrier()
    for i in range(pairs):
        first, second = (dist.all_reduce, comm.all_reduce) if i % 2 == 0 else (comm.all_reduce, dist.all_reduce)
        t0 = clock()
        first(tensor)
        t1 = clock()
        second(tensor)
        t2 = clock()
        if i % 2 == 0:
            raw.append(t1 - t0)
            ours.append(t2 - t1)
        else:
            ours.append(t1 - t0)
            raw.append(t2 - t1)
    q_raw = statistics.quantiles(raw, n=4)
    q_ours = statistics.quantiles(ours, n=4)
    return q_raw[1] * 1e-9, q_ours[1] * 1e-9, q_raw[0] * 1e-9, q_ours[0] * 1e-9


def measure(rank: int, world: int, sizes: list[int], iters: int, rounds: int) -> dict:
    from polyaccel import comm
    from polyaccel.comm.tracing import CommTracer

    results = {}
    for numel in sizes:
        tensor = torch.randn(numel)
        variants = {"raw": [], "polyaccel": [], "traced": []}
        for call in (dist.all_reduce, comm.all_reduce):  # warm-up
            _block(call, tensor, max(50, iters // 10))
        for i in range(rounds):
            # alternate which goes first, so a drift in machine load favours neither
            order = ("raw", "polyaccel") if i % 2 == 0 else ("polyaccel", "raw")
            for name in order:
                variants[name].append(_block(dist.all_reduce if name == "raw" else comm.all_reduce, tensor, iters))
            with CommTracer():
                variants["traced"].append(_block(comm.all_reduce, tensor, iters))
        results[numel] = {k: statistics.median(v) for k, v in variants.items()}
        results[numel]["single"] = interleaved(tensor, iters * rounds // 2)
        results[numel]["raw_min"] = min(variants["raw"])
        results[numel]["polyaccel_min"] = min(variants["polyaccel"])
        # each round's two blocks ran back to back: their ratio cancels slow changes in load
        results[numel]["paired"] = statistics.median(
            p / r for p, r in zip(variants["polyaccel"], variants["raw"], strict=True))
    return results


def layer_cost(calls: int = 200_000) -> tuple[float, float]:
    """Seconds per call of a no-op transport, called directly and through polyaccel.comm."""
    from polyaccel import comm

    tensor = torch.ones(1)
    real = dist.all_reduce
    noop = lambda tensor, op=None, group=None, async_op=False: None  # noqa: E731
    dist.all_reduce = noop
    try:
        timings = {"direct": [], "layer": []}
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                noop(tensor, comm.ReduceOp.SUM, None, False)
            timings["direct"].append((time.perf_counter() - start) / calls)
            start = time.perf_counter()
            for _ in range(calls):
                comm.all_reduce(tensor)
            timings["layer"].append((time.perf_counter() - start) / calls)
    finally:
        dist.all_reduce = real
    return min(timings["direct"]), min(timings["layer"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200, help="calls per timed block")
    ap.add_argument("--rounds", type=int, default=51, help="alternating rounds per size")
    ap.add_argument("--sizes", default="1,256,4096", help="float32 element counts, comma separated")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    from polyaccel.testing.multiprocess import run_ranks

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import comm_overhead  # the ranks unpickle `measure` from this module by name

    res = run_ranks(comm_overhead.measure, 2, sizes, args.iters, args.rounds, timeout=600)[0]
    print(f"gloo, 2 ranks, torch {torch.__version__}; {args.rounds} rounds x {args.iters} calls; "
          "time per all_reduce call (median of rounds)")
    print(f"{'elements':>9} {'bytes':>7} {'raw us':>8} {'polyaccel us':>13} {'ratio':>6} {'paired':>7} "
          f"{'ratio(min)':>10} {'traced us':>10} {'traced ratio':>12}")
    worst = 0.0
    for numel, r in res.items():
        worst = max(worst, r["paired"])
        print(f"{numel:>9} {numel * 4:>7} {r['raw'] * 1e6:>8.2f} {r['polyaccel'] * 1e6:>13.2f} "
              f"{r['polyaccel'] / r['raw']:>6.3f} {r['paired']:>7.3f} {r['polyaccel_min'] / r['raw_min']:>10.3f} "
              f"{r['traced'] * 1e6:>10.2f} {r['traced'] / r['raw']:>12.3f}")
    print("ratio = median polyaccel / median raw; paired = median over rounds of (polyaccel / raw) of adjacent blocks")
    print(f"worst paired untraced ratio: {worst:.3f} (target < 1.05)")
    print("single calls, raw and polyaccel alternating call by call (robust to load spikes):")
    print(f"{'elements':>9} {'raw p50 us':>11} {'polyaccel p50 us':>17} {'ratio p50':>9} {'raw p25 us':>11} "
          f"{'polyaccel p25 us':>17} {'ratio p25':>9}")
    for numel, r in res.items():
        raw50, ours50, raw25, ours25 = r["single"]
        print(f"{numel:>9} {raw50 * 1e6:>11.2f} {ours50 * 1e6:>17.2f} {ours50 / raw50:>9.3f} {raw25 * 1e6:>11.2f} "
              f"{ours25 * 1e6:>17.2f} {ours25 / raw25:>9.3f}")
    worst_single = max(r["single"][1] / r["single"][0] for r in res.values())
    print(f"worst single-call median ratio: {worst_single:.3f} (target < 1.05)")

    direct, layer = layer_cost()
    print(f"layer cost with a no-op transport: direct {direct * 1e9:.0f} ns/call, through polyaccel.comm "
          f"{layer * 1e9:.0f} ns/call (+{(layer - direct) * 1e9:.0f} ns)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
