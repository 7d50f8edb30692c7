"""AutoEP's MoE layer at ep 1 against the Hugging Face MoE block, in the same process (bf16).

    python benchmarks/autoep_gpu.py [--hidden 2048 --ffn 1536 --experts 8 64 --tokens 4096 32768 --topk 2 8]
                                    [--steps 10] [--out results.json]
    python benchmarks/autoep_gpu.py --quick          # small sizes, runs on the CPU too

For every (experts E, tokens T, top-k k) a Mixtral-style block (``MixtralSparseMoeBlock``,
hidden H, expert width F, random bf16 weights) is built once; AutoEP is applied to a copy
(ep 1: no collective). Measured on the selected polyaccel accelerator:

- tokens/s of forward + backward (loss ``(out * g).sum()``) for the HF block with its eager
  expert loop (``experts_implementation="eager"``: one GEMM chain per expert hit), the HF
  block with transformers' own ``grouped_mm`` experts where it runs, AutoEP as it runs by
  default (the default config, ``capture_graphs: "auto"``: device graphs where the routed rows
  are few enough to pay, with the fused expert ops ``moe_gate_up`` / ``moe_down_combine`` where
  the registry chooses a plugin's builder of them: on a GPU the cuda plugin's ``torch_moe_*``,
  the unfused chain's kernels in one autograd node per op; the ``default`` line says whether it
  replayed and gives the layer's ``_graphs.stats``), AutoEP eagerly (``capture_graphs: false``,
  ``eager`` line) and AutoEP with ``capture_graphs: true`` (``graphs`` line, where the
  accelerator has graphs). For the default and the graphs lines, the memory the graphs hold
  between steps is reported, and the max |difference| of one step's output and expert
  gradients against the eager AutoEP layer;
- the host's side of a step (``host ms``: the median time until a step's Python returns, the
  device idle at its start, so no wait for a full launch queue is in it) and what the step asks
  of the device (``launches``: aten kernels and Triton launches, counted at the dispatcher by
  ``polyaccel.testing.launches``; ``syncs``: reads of device values back to the host). Where the
  host's time exceeds the device's, the step is bound by the host and its tokens/s moves with the
  machine's CPU;
- peak memory of one forward + backward (where the accelerator reports memory statistics);
- max |AutoEP - HF eager| of the forward output, and the output's max |value| for scale;
- the expert GEMMs alone: AutoEP's two ``polyaccel.ops.grouped_mm`` calls (the builder the
  registry picks for the device, named in the output) against ``torch._grouped_mm`` on the same
  sorted tokens, weights and offsets, in TFLOP/s (forward, 2*N*H*2F + 2*N*F*H FLOPs, N = T*k),
  timed as back-to-back calls in interleaved rounds like the steps;
  where k = E AutoEP runs the experts as one dense MLP, and its two dense products are timed
  instead ("dense matmul").

Targets (issue): AutoEP >= 2x the HF eager block's tokens/s and >= 1.3x the HF grouped_mm
block's; expert GEMMs >= 0.95 of the ``torch._grouped_mm`` rate. Step timings (tokens/s) are
medians over ``--steps`` rounds in which every block runs a batch of back-to-back steps in turn
(:func:`interleaved_step_s`; the device synchronised around each batch, not each step); the GEMM
rates the same way, per call.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import statistics
import time

import torch


def _sync(acc):
    acc.synchronize()


def interleaved_step_s(fns: dict, acc, rounds: int, min_batch_s: float = 0.02, warmup: int = 2) -> dict:
    """Median seconds a step of each of ``fns``, measured side by side.

    Each of ``rounds`` rounds times a batch of back-to-back steps of every fn in turn (the order rotated
    one place each round), the device synchronised around the batch only: the steps queue as in
    training, so a host-bound step is timed by its host work, not by a sync's round trip; and a slow
    stretch of the machine falls on every fn alike instead of on whichever ran then. A batch holds
    enough steps to last ``min_batch_s`` (one step of a slow fn). Returns {name: seconds a step}.
    """
    batch = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        _sync(acc)
        t0 = time.perf_counter()
        fn()
        _sync(acc)
        batch[name] = max(1, math.ceil(min_batch_s / max(time.perf_counter() - t0, 1e-9)))
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            fn, n = fns[name], batch[name]
            _sync(acc)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            _sync(acc)
            times[name].append((time.perf_counter() - t0) / n)
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_bytes(fn, acc) -> int | None:
    if not acc.has("memory_stats"):
        return None
    acc.empty_cache()
    _sync(acc)
    acc.reset_peak_memory_stats()
    base = acc.memory_allocated()
    fn()
    _sync(acc)
    return acc.max_memory_allocated() - base


def hf_block(E: int, k: int, H: int, F: int, impl: str, device, seed: int = 0):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=k,
                        router_jitter_noise=0.0, experts_implementation=impl)
    torch.manual_seed(seed)
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block.to(device=device, dtype=torch.bfloat16)


def autoep_block(block, fused: bool | None = None, graphs: bool | str | None = None):
    """AutoEP on a copy of ``block``; ``fused`` sets ``fused_experts`` (None: the fused ops where provided),
    ``graphs`` sets ``capture_graphs`` (None: left out, the default config: "auto")."""
    from polyaccel.engines.autoep import apply_autoep

    holder = torch.nn.Module()
    holder.config = None
    holder.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"mlp": copy.deepcopy(block)})])
    section = {"preset_model": "mixtral"}
    if graphs is not None:
        section["capture_graphs"] = graphs
    apply_autoep(holder, section)
    ep = holder.layers[0]["mlp"]
    ep.fused_experts = fused
    return ep


def train_step(block, x, g):
    """A forward + backward of ``block`` on ``x`` (loss ``(out * g).sum()``), gradients reset; returns the output."""
    def fn():
        for p in block.parameters():
            p.grad = None
        xx = x.detach().requires_grad_(True)
        out = block(xx)
        out = out[0] if isinstance(out, tuple) else out
        (out.float() * g).sum().backward()
        return out
    return fn


def graphs_check(graphed, eager, x, g, acc, prefix: str = "graphs") -> dict:
    """Capture ``graphed`` (one warm step), then one step of each on the same input: max |diff| of the output and
    of the expert gradients, and the device memory the graphs hold (allocated by the capture, gradients aside);
    ``{prefix}_stats``: the layer's ``_graphs.stats`` (whether it captured and replayed, or why it ran eagerly)."""
    params = list(graphed.parameters())
    stats = acc.has("memory_stats")
    if stats:
        acc.empty_cache()
    acc.synchronize()
    before = acc.memory_reserved() if stats else None
    train_step(graphed, x, g)()
    acc.synchronize()
    held = None
    if stats:  # what stays reserved once the caching allocator lets go of its free blocks: the graphs' pools
        acc.empty_cache()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        held = acc.memory_reserved() - before - grads
        if graphed._graphs is None or not graphed._graphs.entries:
            held = 0  # nothing captured: what moved is the eager step's own (gradients, allocator blocks)
    outs = []
    for block in (graphed, eager):
        out = train_step(block, x, g)()
        outs.append((out.detach().float(), [p.grad.float() for p in block.local_experts.parameters()]))
    (yg, gg), (ye, ge) = outs
    return {f"{prefix}_max_abs_diff": float((yg - ye).abs().max()),
            f"{prefix}_grad_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(gg, ge, strict=True)),
            f"{prefix}_held_bytes": held,
            f"{prefix}_stats": dict(graphed._graphs.stats) if graphed._graphs is not None else {}}


def host_side(step, acc, steps: int) -> dict:
    """The host's side of ``step``: median ms until it returns (the device synchronised before each, so the
    launch queue is empty and the host never waits on it), and the launches and host syncs of one step."""
    from polyaccel.testing.launches import Launches

    times = []
    for _ in range(steps):
        _sync(acc)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    _sync(acc)
    with Launches() as counted:
        step()
    _sync(acc)
    launches = counted.total + sum(counted.triton.values())
    syncs = sum(counted.syncs.values())
    return {"host_ms": statistics.median(times) * 1e3, "launches": launches, "syncs": syncs}


def gemm_rates(ep_block, x, acc, steps):
    """(ours TFLOP/s, torch._grouped_mm TFLOP/s, builder name) on the layer's own routing of ``x``."""
    from polyaccel import ops
    from polyaccel.engines.autoep.moe import route
    from polyaccel.ops.offsets import mark_complete

    with torch.no_grad():
        flat = x.reshape(-1, x.shape[-1])
        logits = ep_block.router(flat)
        logits = logits[0] if isinstance(logits, tuple) else logits
        _, idx = route(logits, ep_block.routing)
        order = torch.argsort(idx.reshape(-1), stable=True)
        xs = flat.index_select(0, order // idx.shape[1]).contiguous()
        counts = torch.bincount(idx.reshape(-1), minlength=ep_block.num_experts)
        off64 = torch.cumsum(counts, 0)
        off32 = off64.to(torch.int32)
        w1, w2 = ep_block.local_experts.weights()
        F = w2.shape[1]
        a = torch.randn(xs.shape[0], F, device=xs.device, dtype=xs.dtype)
    n, h = xs.shape
    flops = 2 * n * h * 2 * F + 2 * n * F * h

    dense = ep_block._uses_dense(idx.shape[1])
    if dense:  # every token to every expert: AutoEP's products are the dense ones of run_dense_experts
        E = w1.shape[0]
        w1d = w1.permute(1, 0, 2).reshape(h, E * 2 * F)
        w2d = w2.reshape(E * F, h)
        ad = a.view(flat.shape[0], E * F)

    def ours():
        with torch.no_grad():
            if dense:
                flat @ w1d
                ad @ w2d
                return
            # the end rows marked valid by construction, as the layer marks its own: no read back to check them
            mark_complete(off64, n)
            ops.grouped_mm(xs, w1, off64)
            ops.grouped_mm(a, w2, off64)

    def torch_gm():
        with torch.no_grad():
            torch._grouped_mm(xs, w1, offs=off32)
            torch._grouped_mm(a, w2, offs=off32)

    builder = "dense matmul" if dense else ops.registry.chosen("grouped_mm", xs.device.type).name
    pair = {"ours": ours}
    try:
        torch_gm()
        pair["torch"] = torch_gm
    except Exception:  # noqa: BLE001 - torch._grouped_mm missing for this device/dtype
        pass
    # back-to-back calls, interleaved with torch._grouped_mm's: the rate of the GEMMs as a layer issues them (a
    # wrapper's host time overlaps the device's work), not of one call's round trip to a synchronisation
    times = interleaved_step_s(pair, acc, steps)
    t_ours, t_torch = times["ours"], times.get("torch")
    rate = lambda t: flops / t / 1e12 if t else None
    return rate(t_ours), rate(t_torch), builder


def run_case(E, T, k, args, acc, device) -> dict:
    H, F = args.hidden, args.ffn
    eager = hf_block(E, k, H, F, "eager", device)
    ours = autoep_block(eager)  # the default config: capture_graphs "auto"
    ours_eager = autoep_block(eager, graphs=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, T, H, generator=g).to(device=device, dtype=torch.bfloat16)
    grad = torch.randn(1, T, H, generator=g).to(device=device)
    row = {"experts": E, "tokens": T, "top_k": k, "hidden": H, "ffn": F}
    with torch.no_grad():
        want = eager(x)
        got = ours(x)
    row["max_abs_diff"] = float((got.float() - want.float()).abs().max())
    row["max_abs_out"] = float(want.float().abs().max())
    row["fused"] = ours._uses_fused(x)
    if row["fused"]:
        from polyaccel import ops

        row["moe_builders"] = [ops.registry.chosen(op, x.device.type).name for op in ("moe_gate_up",
                                                                                      "moe_down_combine")]
    impls = {"hf_eager": eager, "autoep": ours, "autoep_eager": ours_eager}
    row.update(graphs_check(ours, ours_eager, x, grad, acc, prefix="default"))
    if acc.has("graphs"):
        try:
            graphed = autoep_block(eager, graphs=True)
            row.update(graphs_check(graphed, ours_eager, x, grad, acc))
            impls["autoep_graphs"] = graphed
        except Exception as exc:  # noqa: BLE001 - reported in the row; the other columns still run
            row["graphs_error"] = f"{type(exc).__name__}: {exc}"[:400]
            print(f"capture_graphs failed at E={E} T={T} k={k}: {row['graphs_error']}", flush=True)
    try:
        hf_gm = hf_block(E, k, H, F, "grouped_mm", device)
        with torch.no_grad():
            hf_gm(x[:, :8])
        impls["hf_grouped_mm"] = hf_gm
    except Exception as exc:  # noqa: BLE001 - transformers' grouped_mm path not available here
        row["hf_grouped_mm_error"] = f"{type(exc).__name__}: {exc}"[:160]
    steps = {name: train_step(block, x, grad) for name, block in impls.items()}
    for name, t in interleaved_step_s(steps, acc, args.steps, args.min_batch_ms / 1e3).items():
        row[f"{name}_tokens_per_s"] = T / t
    for name, step in steps.items():
        row[f"{name}_peak_bytes"] = peak_bytes(step, acc)
        row.update({f"{name}_{k}": v for k, v in host_side(step, acc, args.host_steps).items()})
    row["speedup_vs_hf_eager"] = row["autoep_tokens_per_s"] / row["hf_eager_tokens_per_s"]
    row["default_stats"] = dict(ours._graphs.stats)  # after the timed steps too: replayed, or eager and why
    row["default_replayed"] = ours._graphs.stats.get("replayed", 0) > 0
    row["eager_vs_hf_eager"] = row["autoep_eager_tokens_per_s"] / row["hf_eager_tokens_per_s"]
    if "hf_grouped_mm_tokens_per_s" in row:
        row["speedup_vs_hf_grouped_mm"] = row["autoep_tokens_per_s"] / row["hf_grouped_mm_tokens_per_s"]
        row["eager_vs_hf_grouped_mm"] = row["autoep_eager_tokens_per_s"] / row["hf_grouped_mm_tokens_per_s"]
    if "autoep_graphs_tokens_per_s" in row:
        row["graphs_vs_hf_eager"] = row["autoep_graphs_tokens_per_s"] / row["hf_eager_tokens_per_s"]
        if "hf_grouped_mm_tokens_per_s" in row:
            row["graphs_vs_hf_grouped_mm"] = row["autoep_graphs_tokens_per_s"] / row["hf_grouped_mm_tokens_per_s"]
    ours_tf, torch_tf, builder = gemm_rates(ours, x, acc, args.steps)
    row.update(gemm_builder=builder, gemm_tflops=ours_tf, torch_grouped_mm_tflops=torch_tf,
               gemm_fraction=(ours_tf / torch_tf) if (ours_tf and torch_tf) else None)
    for b in impls.values():
        b.to("meta")  # free the weights before the next case
    return row


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _mb(b):
    return "-" if b is None else f"{b / 2**20:.0f}"


HEAD = (f"{'E':>3} {'T':>6} {'k':>2} | {'HF eager tok/s':>14} {'HF gmm tok/s':>13} {'AutoEP tok/s':>13} "
        f"{'x eager':>7} {'x gmm':>6} | {'host ms gmm/AEP':>15} {'launches gmm/AEP':>16} {'syncs':>5} | "
        f"{'peak MB HF/AEP':>15} | {'max|diff|':>9} {'max|out|':>8} | {'GEMM TF/s':>9} {'_grouped_mm':>11} "
        f"{'frac':>5}")


def _print_row(r: dict) -> None:
    host = f"{_fmt(r.get('hf_grouped_mm_host_ms'), '.2f')}/{r['autoep_host_ms']:.2f}"
    launches = f"{_fmt(r.get('hf_grouped_mm_launches'), 'd')}/{r['autoep_launches']}"
    print(f"{r['experts']:>3} {r['tokens']:>6} {r['top_k']:>2} | {r['hf_eager_tokens_per_s']:>14,.0f} "
          f"{_fmt(r.get('hf_grouped_mm_tokens_per_s'), '>13,.0f')} {r['autoep_tokens_per_s']:>13,.0f} "
          f"{r['speedup_vs_hf_eager']:>6.2f}x {_fmt(r.get('speedup_vs_hf_grouped_mm'), '>5.2f')}x | "
          f"{host:>15} {launches:>16} {r['autoep_syncs']:>5} | "
          f"{_mb(r['hf_eager_peak_bytes']) + '/' + _mb(r['autoep_peak_bytes']):>15} | "
          f"{r['max_abs_diff']:>9.2e} {r['max_abs_out']:>8.2e} | {_fmt(r['gemm_tflops'], '>9.2f')} "
          f"{_fmt(r['torch_grouped_mm_tflops'], '>11.2f')} {_fmt(r['gemm_fraction'], '>5.2f')}"
          + (f"  (default path: {' + '.join(r['moe_builders'])})" if r["fused"] else ""), flush=True)
    print(f"{'':>13}| default (capture_graphs auto): {'replayed' if r['default_replayed'] else 'eager'}, "
          f"held {_mb(r['default_held_bytes'])} MB, |diff| vs eager out {r['default_max_abs_diff']:.2e} "
          f"expert grads {r['default_grad_max_abs_diff']:.2e}, {r['default_stats']}", flush=True)
    print(f"{'':>13}| eager (capture_graphs false): {r['autoep_eager_tokens_per_s']:>13,.0f} tok/s, "
          f"{r['eager_vs_hf_eager']:.2f}x eager, {_fmt(r.get('eager_vs_hf_grouped_mm'), '.2f')}x gmm, "
          f"host {r['autoep_eager_host_ms']:.2f} ms, peak {_mb(r['autoep_eager_peak_bytes'])} MB", flush=True)
    if "autoep_graphs_tokens_per_s" in r:
        print(f"{'':>13}| graphs (capture_graphs true): {r['autoep_graphs_tokens_per_s']:>13,.0f} tok/s, "
              f"{r['graphs_vs_hf_eager']:.2f}x eager, "
              f"{_fmt(r.get('graphs_vs_hf_grouped_mm'), '.2f')}x gmm, "
              f"host {r['autoep_graphs_host_ms']:.2f} ms, "
              f"peak {_mb(r['autoep_graphs_peak_bytes'])} MB + held {_mb(r['graphs_held_bytes'])} MB, "
              f"|diff| out {r['graphs_max_abs_diff']:.2e} "
              f"expert grads {r['graphs_grad_max_abs_diff']:.2e}, "
              f"{r['graphs_stats']}", flush=True)


def _print_summary(rows: list[dict]) -> None:
    builders = sorted({r["gemm_builder"] for r in rows})
    print(f"expert GEMMs ran on {', '.join(map(repr, builders))}; targets: >= 2x HF eager and >= 1.3x HF "
          "grouped_mm tokens/s, GEMM fraction >= 0.95 of torch._grouped_mm")
    gm = [r["speedup_vs_hf_grouped_mm"] for r in rows if "speedup_vs_hf_grouped_mm" in r]
    gg = [r["graphs_vs_hf_grouped_mm"] for r in rows if "graphs_vs_hf_grouped_mm" in r]
    if gg:
        print(f"AutoEP with capture_graphs: min x HF grouped_mm {min(gg):.2f}, min x HF eager "
              f"{min(r['graphs_vs_hf_eager'] for r in rows if 'graphs_vs_hf_eager' in r):.2f}")
    print(f"AutoEP (default path: capture_graphs auto) min x HF grouped_mm {min(gm):.2f} (target >= 1.3)" if gm
          else "no HF grouped_mm rows")
    em = [r["eager_vs_hf_grouped_mm"] for r in rows if "eager_vs_hf_grouped_mm" in r]
    if em:
        print(f"AutoEP eager (capture_graphs false) min x HF grouped_mm {min(em):.2f}")
    print("default path replayed its graphs in rows: "
          + (", ".join(f"E {r['experts']} T {r['tokens']} k {r['top_k']}" for r in rows if r["default_replayed"])
             or "none"))
    host = [r["autoep_host_ms"] for r in rows]
    launches = [r["autoep_launches"] for r in rows]
    print(f"AutoEP (default path) host ms a step {min(host):.2f}-{max(host):.2f}, launches a step "
          f"{min(launches)}-{max(launches)}, host syncs a step {max(r['autoep_syncs'] for r in rows)} max")
    worst = min(r["speedup_vs_hf_eager"] for r in rows)
    fracs = [r["gemm_fraction"] for r in rows if r["gemm_fraction"] is not None]
    print(f"min speed-up vs HF eager {worst:.2f}x; min GEMM fraction "
          f"{min(fracs):.2f}" if fracs else f"min speed-up vs HF eager {worst:.2f}x")


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--topk", type=int, nargs="+", default=[2, 8])
    p.add_argument("--steps", type=int, default=10, help="rounds of the interleaved timings")
    p.add_argument("--min-batch-ms", type=float, default=20.0,
                   help="each round times back-to-back steps of a block lasting at least this long")
    p.add_argument("--host-steps", type=int, default=10, help="steps whose host time is taken (median)")
    p.add_argument("--quick", action="store_true", help="small sizes (hidden 64, ffn 128, tokens 256/1024, 2 steps)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.ffn, args.tokens, args.steps, args.host_steps = 64, 128, [256, 1024], 2, 3

    import polyaccel

    acc = polyaccel.get_accelerator()
    device = acc.device()
    torch.manual_seed(0)
    print(f"device: {acc.name} ({device}), torch {torch.__version__}; H={args.hidden} F={args.ffn} bf16, "
          f"fwd+bwd, median of {args.steps} interleaved rounds; host ms: median of {args.host_steps} steps")
    print(HEAD)
    print("-" * len(HEAD))
    rows = []
    for E in args.experts:
        for T in args.tokens:
            for k in args.topk:
                if k > E:
                    continue
                rows.append(run_case(E, T, k, args, acc, device))
                gc.collect()  # the case's blocks and their graphs' pools gone: the next "auto" budget starts empty
                if acc.has("memory_stats"):
                    acc.empty_cache()
                _print_row(rows[-1])
                if args.out:  # after every row: a run cut short keeps what it measured
                    with open(args.out, "w") as f:
                        json.dump(rows, f, indent=1)
    if rows:
        _print_summary(rows)
    return rows


if __name__ == "__main__":
    main()
