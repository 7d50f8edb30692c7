# ruff: noqa: B023 -- every lambda is timed at once, inside its loop iteration
"""Tile sweep of the fused expert kernels (one config at a time, no autotuner), for the tile tables.

    python benchmarks/moe_tiles_gpu.py [--rows E,T,k ...] [--hidden 2048 --ffn 1536]

Prints TFLOP/s per (kernel, BM, BN, BK, warps, stages) and torch._grouped_mm's rate on the same
GEMM (the gate/up and down projections, forward).
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

CONFIGS = [(128, 64, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4),
           (128, 128, 32, 8, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 64, 64, 4, 4),
           (128, 128, 64, 4, 3), (256, 128, 64, 8, 3)]


WGRAD = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 3), (128, 128, 32, 8, 4),
         (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", nargs="*", default=["8,32768,8", "64,4096,2", "8,4096,2"])
    p.add_argument("--wgrad", action="store_true", help="sweep the weight-gradient kernel instead")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1536)
    args = p.parse_args()
    from moe_experts_gpu import make_case
    from polyaccel.ops.reference.moe_experts import routed_tokens
    from polyaccel.plugins.cuda.kernels import moe_experts as km
    from polyaccel.plugins.cuda.kernels.grouped_mm import TileConfig

    H, F = args.hidden, args.ffn
    for row in args.rows:
        E, T, k = (int(v) for v in row.split(","))
        c = make_case(E, T, k, H, F, torch.device("cuda"))
        n = T * k
        tok = routed_tokens(c["index"])
        w1, w2 = c["gate_up"].transpose(1, 2), c["down"].transpose(1, 2)
        off = c["offsets"]
        h = torch.randn(n, F, device="cuda", dtype=torch.bfloat16)
        xs = c["x"].index_select(0, tok)
        f_up, f_dn = 2 * n * H * 2 * F, 2 * n * F * H
        ms = triton.testing.do_bench(lambda: torch._grouped_mm(xs, w1, offs=off.int()))
        print(f"E={E} T={T} k={k}: torch._grouped_mm gate/up {f_up / ms / 1e9:.0f} TF/s", flush=True)
        ms = triton.testing.do_bench(lambda: torch._grouped_mm(h, w2, offs=off.int()))
        print(f"E={E} T={T} k={k}: torch._grouped_mm down {f_dn / ms / 1e9:.0f} TF/s", flush=True)
        if args.wgrad:
            d_gu = torch.randn(n, 2 * F, device="cuda", dtype=torch.bfloat16)
            g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            s = torch.rand(n, device="cuda")
            dr = g.index_select(0, tok)
            ms = triton.testing.do_bench(lambda: torch._grouped_mm(xs.t(), d_gu, offs=off.int()))
            ms2 = triton.testing.do_bench(lambda: torch._grouped_mm(h.t(), dr, offs=off.int()))
            print(f"  torch._grouped_mm wgrad: dw1 {f_up / ms / 1e9:.0f} TF/s, dw2 {f_dn / ms2 / 1e9:.0f} TF/s")
            for cfg in WGRAD:
                tc = TileConfig(*cfg)
                try:
                    ms = triton.testing.do_bench(lambda: km.gathered_wgrad(c["x"], d_gu, off, E, a_idx=tok, like=w1,
                                                                           config=tc))
                    ms2 = triton.testing.do_bench(lambda: km.gathered_wgrad(h, g, off, E, b_idx=tok, b_scale=s,
                                                                            like=w2, config=tc))
                    print(f"  {cfg}: dw1 {f_up / ms / 1e9:.0f} TF/s, dw2 {f_dn / ms2 / 1e9:.0f} TF/s", flush=True)
                except Exception as exc:  # noqa: BLE001 - a config out of resources
                    print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        for cfg in CONFIGS:
            tc = TileConfig(*cfg)
            try:
                ms_up = triton.testing.do_bench(lambda: km.gate_up_forward(c["x"], tok, w1, off, config=tc))
                ms_dn = triton.testing.do_bench(lambda: km.down_forward(h, w2, off, config=tc))
                print(f"  {cfg}: gate_up {f_up / ms_up / 1e9:.0f} TF/s, down {f_dn / ms_dn / 1e9:.0f} TF/s",
                      flush=True)
            except Exception as exc:  # noqa: BLE001 - a config out of resources
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:80]}")


if __name__ == "__main__":
    main()
