"""The host AdamW of ZeRO's offloaded step on a 16-bit gradient: torch's fused kernel on upcast pieces, by piece size.

    python benchmarks/host_adam_upcast.py [--elements 268435456] [--pieces 262144 1048576 4194304 16777216]

Times, in one process on the same fp32 master, moments and bf16 gradient: the fused kernel on an fp32 copy of the
gradient (the 18-bytes-a-parameter layout, no upcast), and ``polyaccel.ops.torch_optim``'s upcast-pieces path at
each piece size (the 16-bytes layout). Prints ms per step and GB/s of AdamW traffic (28 bytes an element with an
fp32 gradient, 26 with bf16), with torch's intra-op threads as set (``--threads``, default torch's).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 28)
    ap.add_argument("--pieces", type=int, nargs="+", default=[1 << 18, 1 << 20, 1 << 22, 1 << 24])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from polyaccel.ops import torch_optim

    n = args.elements
    g = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g)
    m, v = torch.zeros(n), torch.zeros(n)
    g16 = torch.randn(n, generator=g).bfloat16()
    g32 = g16.float()
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    step = torch.tensor(1.0)

    def fp32():
        torch._fused_adamw_([p], [g32], [m], [v], [], [step], **hyper)

    def pieces(size):
        def run():
            torch_optim.UPCAST_PIECE = size
            torch_optim._fused_on_upcast_pieces(torch._fused_adamw_, p, g16, m, v, step, hyper)
        return run

    rows = [("fp32 gradient", fp32, 28)] + [(f"bf16, pieces of {s:,}", pieces(s), 26) for s in args.pieces]
    print(f"{n:,} elements, {torch.get_num_threads()} intra-op threads, median of {args.repeat}")
    default = torch_optim.UPCAST_PIECE
    for name, fn, nbytes in rows:
        fn()
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        print(f"{name:>28}: {t * 1e3:8.1f} ms  {n * nbytes / t / 1e9:6.1f} GB/s", flush=True)
    torch_optim.UPCAST_PIECE = default


if __name__ == "__main__":
    main()
