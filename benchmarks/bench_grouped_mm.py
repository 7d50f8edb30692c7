"""Grouped GEMM for experts: Triton kernel vs ``torch._grouped_mm`` and a per-expert loop, in TFLOP/s.

    python benchmarks/bench_grouped_mm.py [--experts 8] [--tokens 16384] [--k 4096] [--n 14336] [--sweep]

FLOPs counted: 2 * tokens * K * N (forward); forward+backward 3x that (dx and dw). The
ceiling is the dense bf16 matmul rate measured in the same process (8192^3, random data).
Before timing, the Triton forward is checked against an fp32 per-expert reference at the
benchmark size (relative Frobenius error), its backward at a smaller uneven size with an
empty expert, and the forward once with more than 2**31 elements in x (64-bit offsets).
``--sweep`` also times a few tile configurations of the Triton forward.
"""

from __future__ import annotations

import argparse
import importlib

import benchlib
import torch
from benchlib import Row, time_ms

ref = importlib.import_module("polyaccel.ops.reference.grouped_mm")

SWEEP = [  # (BM, BN, BK, warps, stages); the default is (128, 256, 64, 8, 3)
    (128, 256, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (64, 256, 64, 4, 4),
]


def _kernels():
    return importlib.import_module("polyaccel.plugins.cuda.kernels.grouped_mm")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _fp32_reference(x, w, offsets):
    return ref.grouped_mm(x.float(), w.float(), offsets)


def check_backward(device) -> str:
    kg = _kernels()
    t, k, n = 3000, 1024, 1536
    offsets = torch.tensor([0, 700, 700, 1900, 2500, 2990], device=device)  # empty experts, rows past the end
    e = offsets.numel()
    x = torch.randn(t, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(e, k, n, device=device, dtype=torch.bfloat16) / k**0.5).requires_grad_()
    go = torch.randn(t, n, device=device, dtype=torch.bfloat16)
    out = kg.grouped_mm(x, w, offsets)
    dx, dw = torch.autograd.grad(out, (x, w), go)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    rout = ref.grouped_mm(xf, wf, offsets)
    rdx, rdw = torch.autograd.grad(rout, (xf, wf), go.float())
    problems = []
    for what, got, want in (("out", out, rout), ("dx", dx, rdx), ("dw", dw, rdw)):
        r = _rel(got, want)
        if not r < 1e-2:
            problems.append(f"{what} relative error {r:.2e}")
    if not bool((out[2990:] == 0).all()) or not bool((dx[2990:] == 0).all()):
        problems.append("rows past the last offset are not zero")
    if not bool((dw[0] == 0).all()) or not bool((dw[2] == 0).all()):
        problems.append("experts without rows have a nonzero weight gradient")
    return "; ".join(problems)


def check_past_2_31(device) -> str:
    """x with more than 2**31 elements: the last expert's rows start past 2**31."""
    kg = _kernels()
    k, n = 4096, 256
    t = 2**31 // k + 1000
    x = torch.randn(t, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(2, k, n, device=device, dtype=torch.bfloat16) / k**0.5
    offsets = torch.tensor([t - 3000, t - 10], device=device)
    out = kg.grouped_mm_forward(x, w, offsets)
    tail = slice(t - 3000, t - 10)
    r = _rel(out[tail], x[tail].float() @ w[1].float())
    ok_zero = bool((out[t - 10:] == 0).all())
    del x, out
    torch.cuda.empty_cache()
    problems = []
    if not r < 1e-2:
        problems.append(f"rows past 2**31 elements: relative error {r:.2e}")
    if not ok_zero:
        problems.append("rows past the last offset not zero")
    return "; ".join(problems)


def main(argv=None) -> list[Row]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--sweep", action="store_true", help="time several Triton tile configurations")
    ap.add_argument("--skip-2-31", action="store_true")
    args = ap.parse_args(argv)
    dev = benchlib.require_gpu()
    kg = _kernels()
    peak = benchlib.matmul_tflops()
    e, t, k, n = args.experts, args.tokens, args.k, args.n
    x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(e, k, n, device=dev, dtype=torch.bfloat16) / k**0.5
    offsets = torch.arange(1, e + 1, device=dev, dtype=torch.int64) * (t // e)  # balanced, as in the target
    flops = 2 * t * k * n
    rows: list[Row] = []

    def tflops(ms):
        return flops / (ms * 1e-3) / 1e12

    ours_out = kg.grouped_mm_forward(x, w, offsets)
    want = _fp32_reference(x, w, offsets)
    rel = _rel(ours_out, want)
    has_torch = hasattr(torch, "_grouped_mm")
    rel_torch = _rel(kg.torch_grouped_mm(x, w, offsets), want) if has_torch else None
    del want, ours_out
    checks = [f"forward rel. error {rel:.1e} vs fp32 loop" + (f" (torch._grouped_mm {rel_torch:.1e})"
                                                               if rel_torch is not None else "")]
    bad_bwd = check_backward(dev)
    rows.append(Row("grouped_mm", "check backward (dx, dw) vs fp32 reference, uneven + empty experts", "-",
                    "reference", None, None, target="rel. error < 1e-2", met=not bad_bwd,
                    detail=bad_bwd or "ok"))
    if not args.skip_2_31:
        bad31 = check_past_2_31(dev)
        rows.append(Row("grouped_mm", "check forward with x past 2**31 elements", "-", "reference", None, None,
                        target="rel. error < 1e-2", met=not bad31, detail=bad31 or "ok (64-bit offsets)"))

    loop_ms = time_ms(lambda: ref.grouped_mm(x, w, offsets))
    torch_ms = time_ms(lambda: torch._grouped_mm(x, w, offs=offsets.to(torch.int32))) if has_torch else None
    wrap_ms = time_ms(lambda: kg.torch_grouped_mm(x, w, offsets)) if has_torch else None
    ours_ms = time_ms(lambda: kg.grouped_mm_forward(x, w, offsets))
    best_cfg, best_ms = None, ours_ms
    if args.sweep:
        for cfg in SWEEP:
            tc = kg.TileConfig(*cfg)
            try:
                ms = time_ms(lambda tc=tc: kg.grouped_mm_forward(x, w, offsets, config=tc))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                rows.append(Row("grouped_mm", f"sweep {cfg}", "TFLOP/s", "-", None, None, higher_is_better=True,
                                detail=f"failed: {type(exc).__name__}: {str(exc)[:120]}"))
                continue
            rows.append(Row("grouped_mm", f"sweep BM,BN,BK,warps,stages={cfg}", "TFLOP/s", "-", None, tflops(ms),
                            higher_is_better=True, detail=f"{ms:.3f} ms = {tflops(ms) / peak:.1%} of matmul peak"))
            if ms < best_ms:
                best_cfg, best_ms = cfg, ms
    case = f"forward bf16, {e} experts, {t} tokens, {k}->{n}"
    ok = rel < 1e-2
    rows.append(Row("grouped_mm", case, "TFLOP/s", "per-expert loop", tflops(loop_ms), tflops(ours_ms),
                    higher_is_better=True, target="report vs matmul peak",
                    met=None if ok else False,
                    detail=f"ours {ours_ms:.3f} ms = {tflops(ours_ms) / peak:.1%} of matmul peak ({peak:.0f}); "
                           f"loop {loop_ms:.3f} ms; " + "; ".join(checks)))
    if has_torch:
        rows.append(Row("grouped_mm", case, "TFLOP/s", "torch._grouped_mm", tflops(torch_ms), tflops(ours_ms),
                        higher_is_better=True, target="report vs matmul peak", met=None if ok else False,
                        detail=f"torch._grouped_mm {torch_ms:.3f} ms = {tflops(torch_ms) / peak:.1%} of peak; "
                               f"our torch_grouped_mm builder (validation + tail zeroing) {wrap_ms:.3f} ms"))
    if best_cfg is not None:
        rows.append(Row("grouped_mm", f"{case}, best swept tile {best_cfg}", "TFLOP/s", "default tile",
                        tflops(ours_ms), tflops(best_ms), higher_is_better=True,
                        detail=f"{best_ms:.3f} ms = {tflops(best_ms) / peak:.1%} of peak"))

    # forward + backward (dx and dw) through autograd
    xg = x.detach().requires_grad_()
    wg = w.detach().requires_grad_()
    go = torch.randn(t, n, device=dev, dtype=torch.bfloat16)

    def fb(fn):
        def run():
            out = fn(xg, wg, offsets)
            return torch.autograd.grad(out, (xg, wg), go)

        return run

    fb_flops = 3 * flops
    ours_fb = time_ms(fb(kg.grouped_mm))
    base_name, base_fb = "per-expert loop", time_ms(fb(ref.grouped_mm))
    if has_torch:
        base_name, base_fb = "torch._grouped_mm (our builder)", time_ms(fb(kg.torch_grouped_mm))
    rows.append(Row("grouped_mm", f"forward+backward bf16, {e} experts, {t} tokens, {k}->{n}", "TFLOP/s", base_name,
                    fb_flops / (base_fb * 1e-3) / 1e12, fb_flops / (ours_fb * 1e-3) / 1e12, higher_is_better=True,
                    detail=f"ours {ours_fb:.3f} ms, baseline {base_fb:.3f} ms; "
                           f"{fb_flops / (ours_fb * 1e-3) / 1e12 / peak:.1%} of matmul peak"))
    return rows


if __name__ == "__main__":
    benchlib.run_standalone(main)
