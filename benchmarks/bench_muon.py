"""Muon on the GPU: the Triton Newton-Schulz against the bf16 GEMM rate, and a Muon step against torch.optim.Muon.

    python benchmarks/bench_muon.py [--batch 4] [--size 4096] [--sweep] [--only ns|step|zero] [--out muon.json]

(a) ``newton_schulz`` on a batch of ``size x size`` bf16 matrices, 5 iterations. FLOPs counted as
    the plain iteration's: per matrix and iteration three GEMMs, ``X X^T`` (2 m^2 n), ``A A``
    (2 m^3) and ``B X`` (2 m^2 n); the Triton kernels skip the lower halves of the two symmetric
    products, so their rate can exceed the GEMM rate. Compared with ``torch.matmul`` bf16 on
    ``size^3`` in the same process (target: >= 0.70 of it), and the reference composition's rate
    (torch baddbmm, cuBLAS). Checked first against an fp32 iteration (relative Frobenius error).
(b) One optimizer step on a 220M-like set of matrices (12 layers of 1024 hidden: q/k/v/o
    1024x1024, MLP 4096x1024 and 1024x4096; fp32 params): ``torch.optim.Muon`` vs
    ``polyaccel.optim.Muon`` (through ``polyaccel.ops.fused_muon``: the cuda plugin's builder),
    same hyperparameters; the two results after one step are compared too.
(c) ZeRO Muon's Newton-Schulz a step at world size 1 (220M and 1B Llama, batched by wide shape as the
    engine does): the Triton op against the reference composition per batch, and the sum. With ``--sweep``,
    each batch as the engine hands it over (square, tall, wide) under each tile configuration, every tile's
    result checked against the default tile's.
"""

from __future__ import annotations

import argparse
import functools
import importlib

import benchlib
import torch
from benchlib import Row, time_ms

ref = importlib.import_module("polyaccel.ops.reference.muon")

SWEEP = [  # (BM, BN, BK, warps, stages, group_m); the default for 4096 is (128, 128, 64, 8, 4, 8)
    (128, 128, 64, 8, 3, 8),
    (128, 256, 64, 8, 3, 8),
    (128, 128, 64, 4, 4, 8),
    (64, 128, 64, 4, 4, 8),
    (128, 128, 32, 8, 5, 8),
]


def _kernels():
    return importlib.import_module("polyaccel.plugins.cuda.kernels.newton_schulz")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def ns_flops(batch: int, m: int, n: int, steps: int = 5) -> float:
    m, n = min(m, n), max(m, n)
    return batch * steps * (2 * m * m * n + 2 * m**3 + 2 * m * m * n)


def check_small(device) -> str:
    """Tall, per-head-like batches and an odd size against the reference (bf16, on the GPU)."""
    kns = _kernels()
    problems = []
    for shape in ((3, 640, 200), (8, 64, 1024), (2, 1000, 1000), (1, 4096, 1024)):
        x = torch.randn(shape, device=device, dtype=torch.bfloat16)
        got = kns.newton_schulz(x)
        want = ref.newton_schulz(x.float())
        r = _rel(got, want)
        if not r < 3e-2:
            problems.append(f"{shape}: rel. error {r:.2e} vs fp32 iteration")
    return "; ".join(problems)


def bench_newton_schulz(args, dev, rows: list[Row]) -> None:
    kns = _kernels()
    b, s = args.batch, args.size
    x = torch.randn(b, s, s, device=dev, dtype=torch.bfloat16)
    mm = [torch.randn(s, s, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    mm_ms = time_ms(lambda: mm[0] @ mm[1])
    mm_tf = 2 * s**3 / (mm_ms * 1e-3) / 1e12
    flops = ns_flops(b, s, s)

    def tf(ms):
        return flops / (ms * 1e-3) / 1e12

    rel = _rel(kns.newton_schulz(x), ref.newton_schulz(x.float()))
    rel_ref = _rel(ref.newton_schulz(x), ref.newton_schulz(x.float()))
    bad_small = check_small(dev)
    rows.append(Row("muon", "check newton_schulz: tall, batched, odd sizes vs fp32 iteration", "-", "reference",
                    None, None, target="rel. error < 3e-2", met=not bad_small, detail=bad_small or "ok"))
    ours_ms = time_ms(lambda: kns.newton_schulz(x))
    ref_ms = time_ms(lambda: ref.newton_schulz(x))
    best = (None, ours_ms)
    if args.sweep:
        for cfg in SWEEP:
            tc = kns.TileConfig(*cfg)
            try:
                ms = time_ms(lambda tc=tc: kns.newton_schulz(x, config=tc))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                rows.append(Row("muon", f"sweep {cfg}", "TFLOP/s", "-", None, None, higher_is_better=True,
                                detail=f"failed: {type(exc).__name__}: {str(exc)[:120]}"))
                continue
            rows.append(Row("muon", f"sweep BM,BN,BK,warps,stages,group={cfg}", "TFLOP/s", "-", None, tf(ms),
                            higher_is_better=True, detail=f"{ms:.3f} ms = {tf(ms) / mm_tf:.1%} of matmul"))
            if ms < best[1]:
                best = (cfg, ms)
    case = f"newton_schulz bf16, {b} x {s}x{s}, 5 steps"
    ok = rel < 3e-2
    ratio = tf(ours_ms) / mm_tf
    rows.append(Row("muon", case, "TFLOP/s", f"torch.matmul bf16 {s}^3", mm_tf, tf(ours_ms), higher_is_better=True,
                    target=">= 0.70 of the bf16 GEMM rate", met=(ratio >= 0.70) if ok else False,
                    detail=f"ours {ours_ms:.3f} ms = {ratio:.1%} of matmul ({mm_tf:.0f} TF/s, {mm_ms:.3f} ms); "
                           f"rel. error {rel:.1e} vs fp32 iteration (reference bf16: {rel_ref:.1e})",
                    extra={"ratio_to_matmul": ratio, "ours_ms": ours_ms, "matmul_ms": mm_ms}))
    rows.append(Row("muon", case, "TFLOP/s", "reference (torch baddbmm)", tf(ref_ms), tf(ours_ms),
                    higher_is_better=True, detail=f"reference {ref_ms:.3f} ms = {tf(ref_ms) / mm_tf:.1%} of matmul"))
    if best[0] is not None:
        rows.append(Row("muon", f"{case}, best swept tile {best[0]}", "TFLOP/s", "default tile", tf(ours_ms),
                        tf(best[1]), higher_is_better=True, detail=f"{best[1]:.3f} ms = {tf(best[1]) / mm_tf:.1%}"))
    print(f"newton_schulz: ours {ours_ms:.3f} ms ({tf(ours_ms):.0f} TF/s, {ratio:.1%} of matmul {mm_tf:.0f}); "
          f"reference {ref_ms:.3f} ms ({tf(ref_ms):.0f} TF/s); rel err {rel:.1e}", flush=True)


#: ZeRO Muon's Newton-Schulz work a step at world size 1 (benchmarks/zero_gpu.py's Llama shapes), as
#: engines/zero/muon.py batches it: every block in the wide orientation, one call per wide shape (here all
#: rounds merged: the fewest, largest calls; a gather_bucket_size below the model's Muon elements splits them)
ZERO_SHAPES = {"220m": [(48, 1024, 1024), (36, 1024, 2816)], "1b": [(64, 2048, 2048), (48, 2048, 5632)]}
#: --sweep of the ZeRO shapes: each batch as the engine hands it over (q/k/v/o square; gate and up tall, iterated
#: as their column-major transposed view; down wide)
ZERO_SWEEP_SHAPES = {"220m": [(48, 1024, 1024), (24, 2816, 1024), (12, 1024, 2816)],
                     "1b": [(64, 2048, 2048), (32, 5632, 2048), (16, 2048, 5632)]}
ZERO_SWEEP = [*SWEEP, (128, 256, 64, 8, 4, 8), (64, 256, 64, 4, 3, 8), (128, 128, 64, 4, 3, 8),
              (128, 64, 64, 4, 4, 8), (64, 64, 64, 4, 4, 8), (128, 128, 64, 8, 4, 4)]


def bench_zero_shapes(args, dev, rows: list[Row]) -> None:
    """The ZeRO Muon step's Newton-Schulz at world size 1: the Triton op and the reference composition (cuBLAS
    baddbmm) on each wide-shape batch, and their sum: the least a Muon step costs over an AdamW step there.
    With ``--sweep``, each batch as the engine hands it over, under every tile configuration of
    :data:`ZERO_SWEEP` against the default."""
    kns = _kernels()
    for size, shapes in ZERO_SHAPES.items():
        total = {"ours": 0.0, "reference": 0.0}
        for b, m, n in shapes:
            x = torch.randn(b, m, n, device=dev, dtype=torch.bfloat16)
            ours_ms = time_ms(lambda x=x: kns.newton_schulz(x))
            ref_ms = time_ms(lambda x=x: ref.newton_schulz(x))
            total["ours"] += ours_ms
            total["reference"] += ref_ms
            tf = ns_flops(b, m, n) / 1e12
            rows.append(Row("muon", f"ZeRO {size} Newton-Schulz batch {b} x {m}x{n}, 5 steps", "ms",
                            "reference (torch baddbmm)", ref_ms, ours_ms,
                            detail=f"ours {tf / (ours_ms * 1e-3):.0f} TF/s, reference {tf / (ref_ms * 1e-3):.0f} TF/s "
                                   "(plain-iteration FLOPs)"))
            print(f"{size} {b}x{m}x{n}: ours {ours_ms:.2f} ms, reference {ref_ms:.2f} ms", flush=True)
        rows.append(Row("muon", f"ZeRO {size} Newton-Schulz a step (all wide shapes)", "ms",
                        "reference (torch baddbmm)", total["reference"], total["ours"],
                        detail="the floor of the Muon step's cost over the AdamW step at world size 1"))
        print(f"{size} total: ours {total['ours']:.2f} ms, reference {total['reference']:.2f} ms", flush=True)
        if args.sweep:
            _sweep_zero_shapes(kns, size, dev, rows)


def _sweep_zero_shapes(kns, size: str, dev, rows: list[Row]) -> None:
    """Each batch under each tile of :data:`ZERO_SWEEP`; a tile whose result differs from the default tile's by more
    than the iteration's bf16 rounding (relative Frobenius 2e-2) is reported as wrong and never the best."""
    for b, m, n in ZERO_SWEEP_SHAPES[size]:
        x = torch.randn(b, m, n, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        default = kns.default_config(min(m, n), max(m, n))
        want = kns.newton_schulz(x).float()
        base_ms = time_ms(lambda x=x, out=out: kns.newton_schulz(x, out=out))
        best = (default, base_ms)
        for cfg in ZERO_SWEEP:
            tc = kns.TileConfig(*cfg)
            try:
                err = _rel(kns.newton_schulz(x, config=tc), want)
                ms = time_ms(lambda tc=tc, x=x, out=out: kns.newton_schulz(x, out=out, config=tc))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                print(f"  sweep {size} {b}x{m}x{n} {cfg}: failed {type(exc).__name__}", flush=True)
                continue
            wrong = err > 2e-2
            print(f"  sweep {size} {b}x{m}x{n} {cfg}: {ms:.3f} ms ({base_ms / ms:.2f}x the default), "
                  f"{err:.1e} from the default's result{' WRONG' if wrong else ''}", flush=True)
            if not wrong and ms < best[1]:
                best = (tc, ms)
        rows.append(Row("muon", f"ZeRO {size} batch {b} x {m}x{n}: best swept tile {best[0]}", "ms",
                        f"default tile {default}", base_ms, best[1]))


def _matrices(layers: int, hidden: int, dev):
    shapes = []
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(4 * hidden, hidden), (hidden, 4 * hidden)]
    return [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s in shapes]


def bench_step(args, dev, rows: list[Row]) -> None:
    import polyaccel
    from polyaccel.optim import Muon

    ours_p = _matrices(args.layers, args.hidden, dev)
    theirs_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    for a, b in zip(ours_p, theirs_p, strict=True):
        g = torch.randn_like(a) * 1e-3
        a.grad, b.grad = g, g.clone()
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
    ours, theirs = Muon(ours_p, **kw), torch.optim.Muon(theirs_p, **kw)
    chosen = polyaccel.ops.registry.chosen("fused_muon", "cuda").name
    ours.step()
    theirs.step()
    worst = max(_rel(a - b.detach(), b.detach()) for a, b in zip(ours_p, theirs_p, strict=True))
    diff = max(float((a - b).abs().max()) for a, b in zip(ours_p, theirs_p, strict=True))
    ours_ms = time_ms(ours.step, warmup_ms=50, rep_ms=500)
    theirs_ms = time_ms(theirs.step, warmup_ms=50, rep_ms=500)
    n = sum(p.numel() for p in ours_p)
    case = f"Muon step, {len(ours_p)} fp32 matrices ({n / 1e6:.0f}M params, {args.layers} layers x {args.hidden})"
    rows.append(Row("muon", case, "ms", "torch.optim.Muon", theirs_ms, ours_ms, target="faster than torch",
                    met=ours_ms < theirs_ms, detail=f"builder {chosen}; after one step max |ours - torch| "
                                                    f"{diff:.2e} (lr 0.02)", extra={"builder": chosen}))
    print(f"step: torch {theirs_ms:.3f} ms, ours {ours_ms:.3f} ms ({theirs_ms / ours_ms:.2f}x) builder {chosen}; "
          f"max diff {diff:.2e} rel {worst:.2e}", flush=True)


def main(argv=None) -> list[Row]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--sweep", action="store_true", help="time several tile configurations of the Triton kernels")
    ap.add_argument("--only", choices=("ns", "step", "zero"), help="run one part only")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    dev = benchlib.require_gpu()
    parts = {part: functools.partial(fn, args, dev)
             for part, fn in (("ns", bench_newton_schulz), ("step", bench_step), ("zero", bench_zero_shapes))}
    return benchlib.run_parts("muon", parts, args.only, args.out)


if __name__ == "__main__":
    benchlib.run_standalone(main)
