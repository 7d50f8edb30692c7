"""Triton SwiGLU forward and forward+backward vs torch eager, ``torch.compile`` and the copy ceiling.

    python benchmarks/bench_swiglu.py [--rows 16384] [--cols 16384]

Bytes counted for N bf16 elements: forward 3 tensor passes (gate, up read; out written),
forward+backward 8 (plus grad_out, gate, up read; d_gate, d_up written). Forward+backward
goes through autograd on both sides (``torch.autograd.grad``, so no ``.grad`` accumulation):
ours is the autograd-aware op (fused forward kernel + fused backward kernel), the baseline is
``torch.compile`` of the reference forward formula, whose backward inductor derives and fuses.
Before timing, both kernels are checked against the reference at the benchmark size, and the
forward once past 2**31 elements (64-bit offsets).
"""

from __future__ import annotations

import argparse
import importlib

import benchlib
import torch
from benchlib import Row, gbs, time_ms

ref = importlib.import_module("polyaccel.ops.reference.swiglu")


def _kernels():
    return importlib.import_module("polyaccel.plugins.cuda.kernels.swiglu")


def _bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error in bf16 ulps of the reference value (the reference rounds fp32 math to bf16 too)."""
    w = want.float()
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(2.0**-126))) - 7)
    return float(((got.float() - w).abs() / ulp).max())


def check(gate, up, go) -> tuple[str, float]:
    """('' or what is wrong, worst error in bf16 ulps) for forward and backward vs the reference."""
    ks = _kernels()
    worst = 0.0
    problems = []
    pairs = [(ks.swiglu_forward(gate, up), ref.swiglu_forward(gate, up), "forward")]
    dg, du = ks.swiglu_backward(go, gate, up)
    rdg, rdu = ref.swiglu_backward(go, gate, up)
    pairs += [(dg, rdg, "d_gate"), (du, rdu, "d_up")]
    for got, want, what in pairs:
        if not bool(torch.isfinite(got).all()):
            problems.append(f"{what} has non-finite values")
        u = _bf16_ulps(got, want)
        worst = max(worst, u)
        if u > 2.0:  # different sigmoid/exp roundings may flip one bf16 rounding; more is a bug
            problems.append(f"{what} off by {u:.1f} bf16 ulps")
    return "; ".join(problems), worst


def check_past_2_31(device) -> str:
    ks = _kernels()
    n = 2**31 + 4099
    gate = torch.randn(n, device=device, dtype=torch.bfloat16)
    up = torch.randn(n, device=device, dtype=torch.bfloat16)
    out = ks.swiglu_forward(gate, up)
    tail = slice(n - 2**20, n)
    u = _bf16_ulps(out[tail], ref.swiglu_forward(gate[tail], up[tail]))
    del gate, up, out
    torch.cuda.empty_cache()
    return "" if u <= 2.0 else f"forward off by {u:.1f} bf16 ulps past 2**31 elements"


def main(argv=None) -> list[Row]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=16384)
    ap.add_argument("--skip-2-31", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time (elements per program, warps) variants")
    args = ap.parse_args(argv)
    dev = benchlib.require_gpu()
    ks = _kernels()
    copy = benchlib.copy_bandwidth_gbs()
    shape = (args.rows, args.cols)
    n = args.rows * args.cols
    gate = torch.randn(shape, device=dev, dtype=torch.bfloat16) * 3
    up = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    go = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    rows: list[Row] = []

    bad, worst = check(gate, up, go)
    checked = f"fwd/bwd vs reference: max {worst:.2f} bf16 ulp" + (f"; FAILED: {bad}" if bad else "")
    if not args.skip_2_31:
        bad31 = check_past_2_31(dev)
        rows.append(Row("swiglu", "check forward past 2**31 elements", "-", "reference", None, None,
                        target="within 2 bf16 ulps", met=not bad31, detail=bad31 or "ok (64-bit offsets)"))

    if args.sweep:
        for block, warps in ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16)):
            f_ms = time_ms(lambda b=block, w=warps: ks.swiglu_forward(gate, up, block=b, num_warps=w))
            b_ms = time_ms(lambda b=block, w=warps: ks.swiglu_backward(go, gate, up, block=b, num_warps=w))
            rows.append(Row("swiglu", f"sweep block={block} warps={warps}", "ms", "-", None, f_ms,
                            detail=f"forward {gbs(3 * 2 * n, f_ms) / copy:.1%} of copy; backward {b_ms:.3f} ms = "
                                   f"{gbs(5 * 2 * n, b_ms) / copy:.1%} of copy"))

    fwd_bytes = 3 * 2 * n
    eager_ms = time_ms(lambda: ref.swiglu_forward(gate, up))
    compiled_fwd = torch.compile(ref.swiglu_forward)
    compiled_fwd(gate, up)
    comp_ms = time_ms(lambda: compiled_fwd(gate, up))
    ours_ms = time_ms(lambda: ks.swiglu_forward(gate, up))
    frac = gbs(fwd_bytes, ours_ms) / copy
    rows.append(Row("swiglu", f"forward bf16 {shape[0]}x{shape[1]}", "ms", "torch.compile(reference)", comp_ms,
                    ours_ms, target=">= 95% of copy", met=frac >= 0.95 and not bad,
                    detail=f"{gbs(fwd_bytes, ours_ms):.0f} GB/s = {frac:.1%} of copy ({copy:.0f}); compile "
                           f"{gbs(fwd_bytes, comp_ms):.0f} GB/s, eager {eager_ms:.3f} ms; {checked}"))

    # forward + backward through autograd on both sides
    g_ = gate.detach().requires_grad_()
    u_ = up.detach().requires_grad_()

    def ours_fb():
        out = ks.swiglu(g_, u_)
        return torch.autograd.grad(out, (g_, u_), go)

    def compiled_fb():
        out = compiled_fwd(g_, u_)
        return torch.autograd.grad(out, (g_, u_), go)

    def eager_fb():
        out = ref.swiglu_forward(g_, u_)
        return torch.autograd.grad(out, (g_, u_), go)

    compiled_fb()
    fb_bytes = 8 * 2 * n
    eager_fb_ms = time_ms(eager_fb)
    comp_fb_ms = time_ms(compiled_fb)
    ours_fb_ms = time_ms(ours_fb)
    rows.append(Row("swiglu", f"forward+backward bf16 {shape[0]}x{shape[1]}", "ms", "torch.compile(reference)",
                    comp_fb_ms, ours_fb_ms, target=">= 1.0x torch.compile",
                    met=comp_fb_ms / ours_fb_ms >= 1.0 and not bad,
                    detail=f"{gbs(fb_bytes, ours_fb_ms):.0f} GB/s = {gbs(fb_bytes, ours_fb_ms) / copy:.1%} of copy "
                           f"(8 passes); compile {gbs(fb_bytes, comp_fb_ms):.0f} GB/s; eager {eager_fb_ms:.3f} ms"))
    return rows


if __name__ == "__main__":
    benchlib.run_standalone(main)
