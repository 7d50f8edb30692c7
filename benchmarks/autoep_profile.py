"""Profile AutoEP's MoE layer (ep 1, bf16, forward + backward) and print where device time goes.

    python benchmarks/autoep_profile.py [--experts 8] [--tokens 32768] [--topk 2] [--rows 25] [--hf]
                                        [--host] [--graphs]

Uses ``autoep_gpu.py``'s block and step (AutoEP's default path: the fused expert ops only where the
registry chooses a plugin's builder of them); ``--hf`` profiles the HF eager block as well (and with
``--host`` transformers' grouped_mm block), ``--graphs`` AutoEP with ``capture_graphs`` (its routed experts
replayed from device graphs). ``--host`` measures the host instead of the device: per
step, the time until the step's Python returns and until the device is done, the device runtime calls
it makes (kernel launches, copies, synchronisations), then the Python functions by own time
(cProfile) - for the small rows, where the device waits on the host.
"""

from __future__ import annotations

import argparse

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--hf", action="store_true", help="profile the HF eager block too")
    ap.add_argument("--host", action="store_true", help="the host's time per step and its Python by own time")
    ap.add_argument("--graphs", action="store_true", help="profile AutoEP with capture_graphs too")
    args = ap.parse_args()

    import polyaccel
    from autoep_gpu import autoep_block, hf_block, train_step
    from torch.profiler import ProfilerActivity, profile

    acc = polyaccel.get_accelerator()
    device = acc.device()
    eager = hf_block(args.experts, args.topk, args.hidden, args.ffn, "eager", device)
    blocks = {"autoep": autoep_block(eager, graphs=False)}  # the eager layer (capture_graphs false): its kernels
    if args.graphs:
        blocks["autoep graphs"] = autoep_block(eager, graphs=True)
    if args.hf:
        blocks["hf eager"] = eager
        if args.host:
            blocks["hf grouped_mm"] = hf_block(args.experts, args.topk, args.hidden, args.ffn, "grouped_mm", device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, generator=g).to(device=device, dtype=torch.bfloat16)
    grad = torch.randn(1, args.tokens, args.hidden, generator=g).to(device=device)
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    for name, block in blocks.items():
        step = train_step(block, x, grad)
        for _ in range(3):
            step()
        acc.synchronize()
        if args.host:
            host_profile(name, step, acc, args.rows)
            continue
        with profile(activities=activities) as prof:
            for _ in range(5):
                step()
            acc.synchronize()
        print(f"== {name}: E={args.experts} T={args.tokens} k={args.topk} (5 steps)")
        sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))
    return 0


def host_profile(name: str, step, acc, rows: int, steps: int = 20) -> None:
    """Median host time of ``step`` (until it returns) and wall time (until the device is done), then cProfile."""
    import cProfile
    import pstats
    import statistics
    import time

    host, wall = [], []
    for _ in range(steps):
        acc.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        acc.synchronize()
        host.append(t1 - t0)
        wall.append(time.perf_counter() - t0)
    print(f"== {name}: host {statistics.median(host) * 1e3:.3f} ms/step until the step returns, "
          f"{statistics.median(wall) * 1e3:.3f} ms until the device is done (median of {steps})")
    print(f"   {launches_per_step(step, acc, steps)}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    acc.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows)


#: the runtime calls counted per step: kernel launches (torch's and Triton's), copies, synchronisations
RUNTIME_CALLS = ("LaunchKernel", "Memcpy", "Synchronize")


def launches_per_step(step, acc, steps: int) -> str:
    """The device runtime calls a step makes (torch profiler's runtime events), per kind: what a step bound by
    the host pays for, one launch at a time."""
    from torch.profiler import ProfilerActivity, profile

    if acc.device().type != "cuda":
        return "runtime calls: counted on a CUDA device only"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        acc.synchronize()
    per = {kind: 0 for kind in RUNTIME_CALLS}
    for event in prof.key_averages():
        for kind in RUNTIME_CALLS:
            if kind in event.key:
                per[kind] += event.count
    return "runtime calls a step: " + ", ".join(f"{k} {v / steps:.1f}" for k, v in per.items())


if __name__ == "__main__":
    raise SystemExit(main())
