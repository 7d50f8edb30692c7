"""Triton group-wise quantize/dequantize vs ``torch.compile`` of the core reference, and the copy ceiling.

    python benchmarks/bench_quantize.py [--numel 268435456] [--group 128]

Bytes counted (each operand read once, each output written once), for N bf16 elements and
groups of G: quantize int8 2N read + N written + 4N/G scales; dequantize N + 4N/G read + 2N
written; int4 halves the 1-byte side and adds N/G zero points (asymmetric). Before timing,
every kernel is checked against the reference on the benchmark input (bit-exact data and
scales; dequantize within one bf16 rounding) and, once, past 2**31 elements (64-bit offsets).
"""

from __future__ import annotations

import argparse
import importlib

import benchlib
import torch
from benchlib import Row, gbs, time_ms

ref = importlib.import_module("polyaccel.ops.reference.quantize")


def _kernels():
    return importlib.import_module("polyaccel.plugins.cuda.kernels.quantize")


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.uint8) != b.view(torch.uint8)).sum())


def check_exact(x: torch.Tensor, mode: str, group: int, symmetric: bool, slice_elems: int = 16 * 2**20) -> str:
    """'' when ours matches the reference, else what differs.

    Bit-exact against the reference run on the CPU (IEEE division) over the first
    ``slice_elems`` elements, quantize and dequantize. Over the whole tensor against the
    reference run on the GPU: torch's CUDA division by a Python scalar multiplies by the
    reciprocal, so that reference's scales may differ from the CPU's by one ulp; more is a bug.
    """
    kq = _kernels()
    m = min(x.numel(), slice_elems) // 1024 * 1024
    xs = x[:m]
    got = kq.quantize(xs, mode, group, symmetric)
    want = ref.quantize(xs.cpu(), mode, group, symmetric)
    problems = []
    if _mismatch(got.data.cpu(), want.data):
        problems.append(f"{_mismatch(got.data.cpu(), want.data)} data bytes differ from the CPU reference")
    if not torch.equal(got.scales.cpu(), want.scales):
        problems.append(f"{int((got.scales.cpu() != want.scales).sum())} scales differ from the CPU reference")
    if not symmetric and not torch.equal(got.zero_points.cpu(), want.zero_points):
        problems.append("zero points differ from the CPU reference")
    on_gpu = ref.QuantizedTensor(want.data.to(x.device), want.scales.to(x.device),
                                 None if symmetric else want.zero_points.to(x.device), mode, group, xs.shape, xs.dtype)
    back, back_ref = kq.dequantize(on_gpu).cpu(), ref.dequantize(want)
    if back.dtype != back_ref.dtype or not torch.equal(back, back_ref):
        problems.append(f"dequantize differs from the CPU reference in {int((back != back_ref).sum())} elements")
    full, full_ref = kq.quantize(x, mode, group, symmetric), ref.quantize(x, mode, group, symmetric)
    ulps = ((full.scales - full_ref.scales).abs() / torch.finfo(torch.float32).eps / full_ref.scales.abs()).max()
    if float(ulps) > 1.0:
        problems.append(f"scales differ from the GPU reference by {float(ulps):.1f} ulps")
    return "; ".join(problems)


def check_past_2_31(device, group: int = 128) -> str:
    """int8 quantize/dequantize of 2**31 + 3 groups of bf16: the groups past 2**31 elements must be right."""
    kq = _kernels()
    n = (2**31 // group + 3) * group
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    got = kq.quantize(x, "int8", group)
    tail = slice(n - 64 * group, n)
    want = ref.quantize(x[tail].cpu(), "int8", group)  # the CPU reference: IEEE division
    problems = []
    if _mismatch(got.data[tail].cpu(), want.data) or not torch.equal(got.scales[-64:].cpu(), want.scales):
        problems.append("quantize wrong past 2**31 elements")
    back = kq.dequantize(got)
    if not torch.equal(back[tail].cpu(), ref.dequantize(ref.quantize(x[tail].cpu(), "int8", group))):
        problems.append("dequantize wrong past 2**31 elements")
    del x, got, back
    torch.cuda.empty_cache()
    return "; ".join(problems)


def _compiled_reference_quantize(mode, group, symmetric):
    def fn(x):
        qt = ref.quantize(x, mode, group, symmetric)
        return qt.data, qt.scales, qt.zero_points

    return torch.compile(fn)


def _compiled_reference_dequantize(mode, group, symmetric, shape, dtype):
    def fn(data, scales, zero_points):
        return ref.dequantize(ref.QuantizedTensor(data, scales, zero_points, mode, group, shape, dtype))

    return torch.compile(fn)


def _nbytes(n, group, mode, symmetric, elem=2):
    qbytes = n // 2 if mode == "int4" else n
    side = 4 * n // group + (0 if symmetric else n // group)
    return n * elem + qbytes + side


def _sweep(x, g, copy) -> list[Row]:
    """int8 symmetric dequantize and quantize under each (division, elements per program, warps) variant."""
    kq = _kernels()
    saved = (kq.FAST_DIV, kq.BLOCK_ELEMS, kq.NUM_WARPS)
    nbytes = _nbytes(x.numel(), g, "int8", True)
    out = []
    qt = kq.quantize(x, "int8", g, True)
    try:
        for block in (4096, 8192):
            for warps in (4, 8):
                kq.BLOCK_ELEMS, kq.NUM_WARPS = block, warps
                ms = time_ms(lambda: kq.dequantize(qt))
                out.append(Row("quantize", f"sweep int8 g{g} dequantize: block={block} warps={warps}", "ms", "-",
                               None, ms, detail=f"{gbs(nbytes, ms) / copy:.1%} of copy"))
        for fast in (False, True):
            for block in (4096, 8192):
                for warps in (4, 8):
                    kq.FAST_DIV, kq.BLOCK_ELEMS, kq.NUM_WARPS = fast, block, warps
                    ms = time_ms(lambda: kq.quantize(x, "int8", g, True))
                    out.append(Row("quantize", f"sweep int8 g{g}: fast_div={fast} block={block} warps={warps}", "ms",
                                   "-", None, ms, detail=f"{gbs(nbytes, ms) / copy:.1%} of copy"))
    finally:
        kq.FAST_DIV, kq.BLOCK_ELEMS, kq.NUM_WARPS = saved
    return out


def main(argv=None) -> list[Row]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=256 * 2**20)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--skip-2-31", action="store_true", help="leave out the 64-bit offset check")
    ap.add_argument("--sweep", action="store_true", help="time int8 quantize tile/division variants")
    ap.add_argument("--quick", action="store_true",
                    help="check every mode at --group only, and leave out the int4/fp8 timing rows")
    args = ap.parse_args(argv)
    dev = benchlib.require_gpu()
    kq = _kernels()
    copy = benchlib.copy_bandwidth_gbs()
    n, g = args.numel, args.group
    x = torch.randn(n, device=dev, dtype=torch.bfloat16) * 3
    rows: list[Row] = []

    # correctness on the benchmark input, every mode
    for mode, sym in (("int8", True), ("int8", False), ("int4", True), ("int4", False), ("fp8", True)):
        groups = (g,) if args.quick else (32, g, 1024) if (mode, sym) == ("int8", True) else (g, 1024)
        for group in groups:
            bad = check_exact(x, mode, group, sym)
            if bad:
                rows.append(Row("quantize", f"check {mode} {'sym' if sym else 'asym'} g{group}", "-", "reference",
                                None, None, target="bit-exact vs reference", met=False, detail=bad))
    where = f"group {g}" if args.quick else "group 128 and 1024 (int8 sym also 32)"
    checked = (f"every mode (int8/int4 sym+asym, fp8) at {where}, bit-exact vs the CPU reference: "
               + ("yes" if not rows else f"{len(rows)} MISMATCHES"))
    if not args.skip_2_31:
        bad = check_past_2_31(dev)
        rows.append(Row("quantize", "check int8 g128 past 2**31 elements", "-", "reference", None, None,
                        target="bit-exact vs reference", met=not bad, detail=bad or "bit-exact (64-bit offsets)"))

    if args.sweep:
        rows += _sweep(x, g, copy)

    # int8 symmetric quantize: the target row
    nbytes = _nbytes(n, g, "int8", True)
    base = _compiled_reference_quantize("int8", g, True)
    base(x)
    base_ms = time_ms(lambda: base(x))
    ours_ms = time_ms(lambda: kq.quantize(x, "int8", g, True))
    frac = gbs(nbytes, ours_ms) / copy
    rows.append(Row("quantize", f"int8 sym quantize, group {g}, {n / 2**20:.0f}M bf16", "ms",
                    "torch.compile(reference)", base_ms, ours_ms,
                    target=">= 1.0x torch.compile, >= 90% of copy",
                    met=base_ms / ours_ms >= 1.0 and frac >= 0.90,
                    detail=f"{gbs(nbytes, ours_ms):.0f} GB/s = {frac:.1%} of copy ({copy:.0f}); baseline "
                           f"{gbs(nbytes, base_ms):.0f} GB/s; {checked}"))

    qt = kq.quantize(x, "int8", g, True)
    dbase = _compiled_reference_dequantize("int8", g, True, qt.shape, qt.dtype)
    dbase(qt.data, qt.scales, None)
    dbase_ms = time_ms(lambda: dbase(qt.data, qt.scales, None))
    dours_ms = time_ms(lambda: kq.dequantize(qt))
    dfrac = gbs(nbytes, dours_ms) / copy
    rows.append(Row("quantize", f"int8 sym dequantize, group {g}, {n / 2**20:.0f}M -> bf16", "ms",
                    "torch.compile(reference)", dbase_ms, dours_ms,
                    target=">= 1.0x torch.compile, >= 90% of copy",
                    met=dbase_ms / dours_ms >= 1.0 and dfrac >= 0.90,
                    detail=f"{gbs(nbytes, dours_ms):.0f} GB/s = {dfrac:.1%} of copy; baseline "
                           f"{gbs(nbytes, dbase_ms):.0f} GB/s"))

    # the other modes: ours against the copy ceiling, informational
    for mode, sym in () if args.quick else (("int4", False), ("fp8", True)):
        nb = _nbytes(n, g, mode, sym)
        q_ms = time_ms(lambda mode=mode, sym=sym: kq.quantize(x, mode, g, sym))
        q = kq.quantize(x, mode, g, sym)
        d_ms = time_ms(lambda q=q: kq.dequantize(q))
        del q
        for what, ms in (("quantize", q_ms), ("dequantize", d_ms)):
            rows.append(Row("quantize", f"{mode} {'sym' if sym else 'asym'} {what}, group {g}", "ms", "-", None, ms,
                            detail=f"{gbs(nb, ms):.0f} GB/s = {gbs(nb, ms) / copy:.1%} of copy"))
    return rows


if __name__ == "__main__":
    benchlib.run_standalone(main)
