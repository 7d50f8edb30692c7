"""The fused expert ops against the unfused ops, on the expert MLP alone (bf16, one device).

    python benchmarks/moe_experts_gpu.py [--hidden 2048 --ffn 1536] [--rows E,T,k ...] [--steps 10] [--out x.json]
                                         [--builders GATE_UP,DOWN]

The fused ops run through the builders the registry chooses (on a GPU the cuda plugin's
``torch_moe_*``, the default path), or the two named by ``--builders`` (a candidate builder
measured against the default path and the unfused chain: what docs/autoep.md asks of one).

For each (experts E, tokens T, top-k k): random token rows, a random top-k routing, router
weights, and expert weights in transformers' layouts (gate_up [E, 2F, H], down [E, H, F], used
transposed as AutoEP does). Prints, per row:

- correctness: max |fused - fp64 reference| and max |unfused - fp64 reference| of the output
  and of every gradient (x, w1, w2, router weights), over max |reference|; the fp64 reference
  is the ops' reference on the device, run for rows with T*k <= --ref-rows;
- times in ms (median of --steps, device synchronised): the fused ``moe_gate_up`` forward
  against index_select + ``ops.grouped_mm`` + ``ops.swiglu``; ``moe_down_combine`` forward
  against ``ops.grouped_mm`` + ``ops.gather_sum``; both ops forward + backward against the
  unfused chain forward + backward;
- peak memory of forward + backward, fused and unfused.

What the lead reads: the fwd+bwd speed-up column (``x``): the fused builders' time against the
unfused chain's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

ROWS = [(8, 4096, 2), (8, 4096, 8), (8, 32768, 2), (8, 32768, 8), (64, 4096, 2), (64, 4096, 8),
        (64, 32768, 2), (64, 32768, 8)]


def median_ms(fn, steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def peak_mb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def make_case(E, T, k, H, F, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    idx = torch.topk(logits, k, dim=-1).indices.to(device)
    weights = torch.softmax(torch.randn(T, k, generator=g), -1).to(device, torch.bfloat16)
    gate_up = (torch.randn(E, 2 * F, H, generator=g) * 0.02).to(device, torch.bfloat16)
    down = (torch.randn(E, H, F, generator=g) * 0.02).to(device, torch.bfloat16)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    index = torch.empty_like(order)
    index[order] = torch.arange(order.numel(), device=device)
    counts = torch.zeros(E, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cumsum(counts, 0)
    grad = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    return dict(x=x, weights=weights, gate_up=gate_up, down=down, index=index.view(T, k), offsets=offsets,
                grad=grad)


def fused_chain(ops, c, leaves):
    x, wts, gu, dn = leaves
    h = ops.moe_gate_up(x, c["index"], gu.transpose(1, 2), c["offsets"])
    return ops.moe_down_combine(h, dn.transpose(1, 2), c["offsets"], c["index"], wts)


def unfused_chain(ops, c, leaves):
    """AutoEP's unfused path: DispatchRows (its backward a gather_sum), run_experts, gather_sum."""
    from polyaccel.engines.autoep.moe import run_experts
    from polyaccel.engines.autoep.permute import DispatchRows

    x, wts, gu, dn = leaves
    index = c["index"]
    inverse = index.reshape(-1)
    order = torch.empty_like(inverse)
    order[inverse] = torch.arange(inverse.numel(), device=inverse.device)
    routed = DispatchRows.apply(x, order, inverse, index.shape[1])
    y = run_experts(routed, gu.transpose(1, 2), dn.transpose(1, 2), c["offsets"])
    return ops.gather_sum(y, index, wts)


def reference_chain(c, leaves):
    from polyaccel.ops import reference as ref

    x, wts, gu, dn = leaves
    h = ref.moe_gate_up(x, c["index"], gu.transpose(1, 2), c["offsets"])
    return ref.moe_down_combine(h, dn.transpose(1, 2), c["offsets"], c["index"], wts)


def leaves_of(c, dtype=None):
    return [c[n].detach().to(dtype or c[n].dtype).clone().requires_grad_(True)
            for n in ("x", "weights", "gate_up", "down")]


def run_grads(chain, c, dtype=None):
    leaves = leaves_of(c, dtype)
    out = chain(leaves)
    out.backward(c["grad"].to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def errors(got, want):
    return [float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
            for a, b in zip(got, want, strict=True)]


def run_row(ops, E, T, k, args, device) -> dict:
    from polyaccel.ops.reference.moe_experts import routed_tokens

    c = make_case(E, T, k, args.hidden, args.ffn, device)
    r = {"experts": E, "tokens": T, "top_k": k}
    fused = lambda lv: fused_chain(ops, c, lv)
    unfused = lambda lv: unfused_chain(ops, c, lv)
    if T * k <= args.ref_rows:
        want = run_grads(lambda lv: reference_chain(c, lv), c, torch.float64)
        r["fused_rel_err"] = errors(run_grads(fused, c), want)
        r["unfused_rel_err"] = errors(run_grads(unfused, c), want)
    else:  # fused against unfused, both bf16
        r["fused_vs_unfused_rel_err"] = errors(run_grads(fused, c), run_grads(unfused, c))
    x, index, off, wts = c["x"], c["index"], c["offsets"], c["weights"]
    w1, w2 = c["gate_up"].transpose(1, 2), c["down"].transpose(1, 2)
    with torch.no_grad():
        h = ops.moe_gate_up(x, index, w1, off)
        r["gate_up_fused_ms"] = median_ms(lambda: ops.moe_gate_up(x, index, w1, off), args.steps)
        r["gate_up_unfused_ms"] = median_ms(lambda: ops.swiglu(*ops.grouped_mm(
            x.index_select(0, routed_tokens(index)), w1, off).chunk(2, -1)), args.steps)
        r["down_fused_ms"] = median_ms(lambda: ops.moe_down_combine(h, w2, off, index, wts), args.steps)
        r["down_unfused_ms"] = median_ms(lambda: ops.gather_sum(ops.grouped_mm(h, w2, off), index, wts),
                                         args.steps)
    h = None  # (freed before the fwd+bwd timings)
    leaves = leaves_of(c)

    def step(chain):
        def fn():
            for t in leaves:
                t.grad = None
            chain(ops, c, leaves).backward(c["grad"])
        return fn

    r["fwd_bwd_fused_ms"] = median_ms(step(fused_chain), args.steps)
    r["fwd_bwd_unfused_ms"] = median_ms(step(unfused_chain), args.steps)
    r["peak_fused_mb"] = peak_mb(step(fused_chain))
    r["peak_unfused_mb"] = peak_mb(step(unfused_chain))
    r["speedup"] = r["fwd_bwd_unfused_ms"] / r["fwd_bwd_fused_ms"]
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, chain in (("fused", fused_chain), ("unfused", unfused_chain)):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step(chain)()
                torch.cuda.synchronize()
            print(f"== {name} E={E} T={T} k={k} (3 steps)")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    return r


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--rows", nargs="*", default=None, help="E,T,k triples (default: the 8 rows of autoep_gpu.py)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ref-rows", type=int, default=8192, help="fp64 reference only where T*k <= this")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true", help="print a kernel table of fwd+bwd, fused and unfused")
    p.add_argument("--builders", default=None, metavar="GATE_UP,DOWN",
                   help="override moe_gate_up and moe_down_combine to these (default: the registry's)")
    args = p.parse_args(argv)
    rows = [tuple(int(v) for v in r.split(",")) for r in args.rows] if args.rows else ROWS

    from polyaccel import ops

    device = torch.device("cuda")
    if args.builders:
        gate_up, down = args.builders.split(",")
        ops.override("moe_gate_up", gate_up)
        ops.override("moe_down_combine", down)
    print(f"torch {torch.__version__}; moe_gate_up builder {ops.registry.chosen('moe_gate_up', 'cuda').name}, "
          f"moe_down_combine builder {ops.registry.chosen('moe_down_combine', 'cuda').name}, "
          f"grouped_mm builder {ops.registry.chosen('grouped_mm', 'cuda').name}; H={args.hidden} F={args.ffn} bf16")
    head = (f"{'E':>3} {'T':>6} {'k':>2} | {'gate_up f/u ms':>15} {'down f/u ms':>13} | {'fwd+bwd f/u ms':>15} "
            f"{'x':>5} | {'peak MB f/u':>13} | rel err fused (out dx dw1 dw2 dwts) / unfused")
    print(head)
    print("-" * len(head))
    results = []
    for E, T, k in rows:
        r = run_row(ops, E, T, k, args, device)
        errs = r.get("fused_rel_err") or r["fused_vs_unfused_rel_err"]
        tail = (" ".join(f"{e:.1e}" for e in errs) + " / "
                + (" ".join(f"{e:.1e}" for e in r["unfused_rel_err"]) if "unfused_rel_err" in r else "(vs unfused)"))
        print(f"{E:>3} {T:>6} {k:>2} | {r['gate_up_fused_ms']:>7.3f}/{r['gate_up_unfused_ms']:<7.3f} "
              f"{r['down_fused_ms']:>6.3f}/{r['down_unfused_ms']:<6.3f} | {r['fwd_bwd_fused_ms']:>7.3f}/"
              f"{r['fwd_bwd_unfused_ms']:<7.3f} {r['speedup']:>5.2f} | {r['peak_fused_mb']:>6.0f}/"
              f"{r['peak_unfused_mb']:<6.0f} | {tail}", flush=True)
        results.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
