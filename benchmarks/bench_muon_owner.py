"""ZeRO Muon's owner's part of a round on the GPU: the previous path against the in-place batches.

    python benchmarks/bench_muon_owner.py [--per-head] [--out owner.json]    (--smoke: tiny shapes on the CPU)

The round buffer of a world-size-1 step (one round holding every Muon matrix of the 220M and the 1B Llama
of benchmarks/zero_gpu.py, bf16 as the engine keeps it for the bf16 iteration of an fp32 model) is
orthogonalized in place two ways, each with the registry's ``newton_schulz`` (the cuda plugin's Triton op):

* previous: matrices in layout order, the blocks of one wide shape gathered by ``torch.cat`` (tall ones
  transposed), one op call per wide shape, split, transposed back, heads re-joined, ``_foreach_copy_`` into
  the buffer (engines/zero/muon.py before the in-place batches, written out below);
* in place: the plan's layout (``plan_rounds``: one batch of one shape and layout next to each other),
  ``muon_batches.orthogonalize_batches``: each batch one view, one op call, one copy back.

Per path: the median time (CUDA events) and the CUDA kernels one call launches (torch.profiler), and the two
results compared (the same bf16 numbers but for the rounding of norms summed in another order). A third row
times the op alone on the tall batch as it lies against the same batch transposed contiguous first (the
column-major reads of the in-place path against the row-major ones it replaces, copy included).
"""

from __future__ import annotations

import argparse
import functools
from types import SimpleNamespace

import benchlib
import torch
from benchlib import Row

#: name: (layers, hidden, intermediate)
MODELS = {"220m": (12, 1024, 2816), "1b": (16, 2048, 5632)}
HEAD_DIM = 64


def _matrices(layers: int, hidden: int, inter: int, per_head: bool):
    """The Muon matrices of the model in layout order: (shape, head split)."""
    h = hidden // HEAD_DIM
    rows, cols = ((0, h), (1, h)) if per_head else (None, None)
    out = []
    for _ in range(layers):
        out += [((hidden, hidden), rows)] * 3 + [((hidden, hidden), cols)]
        out += [((inter, hidden), None), ((inter, hidden), None), ((hidden, inter), None)]
    return out


def _plan(specs, legacy: bool):
    from polyaccel.engines.zero.muon_plan import Matrix, plan_rounds

    ms = [Matrix(i, f"m{i}", shape, split, None, 0.0) for i, (shape, split) in enumerate(specs)]
    cap = sum(m.numel for m in ms)
    (rnd,) = plan_rounds(ms, 1, cap)
    if legacy:
        at = 0
        for m in rnd.matrices:
            m.offset, at = at, at + m.numel
    return rnd


def previous(chunk: torch.Tensor, rnd, mcfg) -> None:
    """The owner's part before the in-place batches (world size 1, no tensor parallelism)."""
    from polyaccel.engines.zero.muon import orthogonalize_many

    views = [chunk[m.offset:m.offset + m.numel].view(m.shape) for m in rnd.matrices]
    done = orthogonalize_many(views, [m.head_split for m in rnd.matrices], mcfg)
    torch._foreach_copy_(views, done)


def in_place(chunk: torch.Tensor, rnd, mcfg) -> None:
    from polyaccel.engines.zero.muon_batches import orthogonalize_batches

    orthogonalize_batches(chunk, rnd.batches, mcfg)


def _kernels(fn, device) -> int | None:
    """The device kernels one call of ``fn`` launches."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def _time(fn, device) -> float | None:
    return benchlib.time_ms(fn) if device.type == "cuda" else None


def bench_model(name: str, args, dev, rows: list[Row]) -> None:
    from polyaccel.ops.reference import muon as ref

    layers, hidden, inter = MODELS[name]
    if args.smoke:
        layers, hidden, inter = 2, 128, 256
    specs = _matrices(layers, hidden, inter, args.per_head)
    mcfg = SimpleNamespace(ns_dtype=torch.bfloat16, ns_steps=5, ns_coefficients=ref.NS_COEFFICIENTS, eps=ref.NS_EPS)
    old_rnd, new_rnd = _plan(specs, True), _plan(specs, False)
    torch.manual_seed(0)
    data = [torch.randn(shape, device=dev).to(torch.bfloat16) for shape, _ in specs]
    bufs = {}
    for key, rnd in (("previous", old_rnd), ("in place", new_rnd)):
        buf = torch.empty(rnd.chunk, device=dev, dtype=torch.bfloat16)
        for m, d in zip(rnd.matrices, data, strict=True):
            buf[m.offset:m.offset + m.numel].copy_(d.view(-1))
        bufs[key] = buf
    previous(bufs["previous"], old_rnd, mcfg)
    in_place(bufs["in place"], new_rnd, mcfg)
    worst = 0.0
    for mo, mn in zip(old_rnd.matrices, new_rnd.matrices, strict=True):
        a = bufs["previous"][mo.offset:mo.offset + mo.numel].float()
        b = bufs["in place"][mn.offset:mn.offset + mn.numel].float()
        worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-30)))
    equal = all(torch.equal(bufs["previous"][mo.offset:mo.offset + mo.numel],
                            bufs["in place"][mn.offset:mn.offset + mn.numel])
                for mo, mn in zip(old_rnd.matrices, new_rnd.matrices, strict=True))
    run_old = lambda: previous(bufs["previous"], old_rnd, mcfg)  # noqa: E731
    run_new = lambda: in_place(bufs["in place"], new_rnd, mcfg)  # noqa: E731
    old_ms, new_ms = _time(run_old, dev), _time(run_new, dev)
    old_k, new_k = _kernels(run_old, dev), _kernels(run_new, dev)
    heads = "per head" if args.per_head else "whole matrices"
    case = f"ZeRO {name} owner's part, one round of {len(specs)} matrices ({heads}), bf16, 5 steps"
    rows.append(Row("muon_owner", case, "ms", "previous (cat, split, foreach copy)", old_ms, new_ms,
                    detail=f"kernels a call {old_k} -> {new_k}; op calls {len(_wide_shapes(old_rnd))} -> "
                           f"{len(new_rnd.batches)}; results bit for bit {equal}, worst relative {worst:.1e}"))
    print(f"{case}: previous {old_ms} ms ({old_k} kernels), in place {new_ms} ms ({new_k} kernels); "
          f"equal {equal}, worst rel {worst:.1e}", flush=True)
    tall = next(b for b in new_rnd.batches if b.key[0] == "rows" and b.key[1] > b.key[2])
    from polyaccel import ops
    from polyaccel.engines.zero.muon_batches import blocks_of

    x = blocks_of(bufs["in place"], tall)
    as_is = _time(lambda: ops.newton_schulz(x), dev)
    transposed = _time(lambda: ops.newton_schulz(x.mT.contiguous()).mT.contiguous(), dev)
    rows.append(Row("muon_owner", f"ZeRO {name} newton_schulz of the tall batch {tuple(x.shape)}", "ms",
                    "transposed contiguous first (copies in and out)", transposed, as_is,
                    detail="as it lies: the kernels read and write it column-major"))
    print(f"tall batch {tuple(x.shape)}: as it lies {as_is} ms, transposed first {transposed} ms", flush=True)


def _wide_shapes(rnd) -> set:
    from polyaccel.ops.reference import muon as ref

    out = set()
    for m in rnd.matrices:
        b = ref.split_heads(torch.empty(m.shape, device="meta"), m.head_split)
        out.add(tuple(sorted(b.shape[-2:])))
    return out


def main(argv=None) -> list[Row]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-head", action="store_true", help="attention projections per head (64-wide blocks)")
    ap.add_argument("--only", choices=tuple(MODELS), help="one model only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (runs on the CPU)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    dev = torch.device("cpu") if args.smoke else benchlib.require_gpu()
    parts = {name: functools.partial(bench_model, name, args, dev) for name in MODELS}
    return benchlib.run_parts("muon_owner", parts, args.only, args.out)


if __name__ == "__main__":
    benchlib.run_standalone(main)
