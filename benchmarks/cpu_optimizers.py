"""cpu plugin optimizers vs torch's CPU optimizers, in one process.

    python benchmarks/cpu_optimizers.py [--params 50e6] [--tensors 50] [--repeats 5]

Prints the median step time of each and the ratio (torch / polyaccel: above 1 means
polyaccel is faster). FusedLion/FusedLamb have no torch counterpart; they are shown
against FusedAdam's bytes moved for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_step(opt, params, repeats):
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # warm-up (allocates state)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--tensors", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import polyaccel
    from polyaccel.optim import FusedAdam, FusedLamb, FusedLion
    from rich.console import Console
    from rich.table import Table

    n = int(args.params) // args.tensors

    def fresh():
        return [torch.nn.Parameter(torch.randn(n)) for _ in range(args.tensors)]

    rows = []
    p = fresh()
    base = _median_step(torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True), p, args.repeats)
    p = fresh()
    ours = _median_step(FusedAdam(p, lr=1e-3, weight_decay=0.01), p, args.repeats)
    rows.append(("AdamW", "torch.optim.AdamW(fused=True)", base, ours))
    p = fresh()
    base_fe = _median_step(torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, foreach=True), p, args.repeats)
    rows.append(("AdamW", "torch.optim.AdamW(foreach=True)", base_fe, ours))
    for name, cls in (("Lion", FusedLion), ("Lamb", FusedLamb)):
        p = fresh()
        rows.append((name, "torch fused AdamW (scale)", base, _median_step(cls(p, lr=1e-4), p, args.repeats)))

    t = Table(title=f"cpu optimizers, {args.tensors} tensors x {n} fp32 = {args.params:.0f} params, "
                    f"{torch.get_num_threads()} threads (plugin {polyaccel.get_accelerator().name})")
    for col in ("optimizer", "baseline", "baseline ms", "polyaccel ms", "ratio baseline/polyaccel"):
        t.add_column(col)
    for name, bl, b, o in rows:
        t.add_row(name, bl, f"{b * 1e3:.1f}", f"{o * 1e3:.1f}", f"{b / o:.2f}")
    Console(width=120).print(t)
    return rows


if __name__ == "__main__":
    main()
