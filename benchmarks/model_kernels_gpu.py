"""The model-layer kernels against their peers, forward and forward + backward, at Llama-3-8B shapes (bf16).

    python benchmarks/model_kernels_gpu.py [--sections rms_norm,rope] [--json out.json]
    python benchmarks/model_kernels_gpu.py --smoke          # tiny shapes on the CPU: checks the script runs
    python benchmarks/model_kernels_gpu.py --sections rms_norm --tune   # + the Triton kernels' tile configurations

One function per kernel section, registered in :data:`SECTIONS`; each returns one :class:`Result` per
implementation: ``polyaccel`` (``polyaccel.ops.<op>``, whatever builder the registry picks: Triton on a
GPU), ``hf_eager`` (Hugging Face's module or function), ``torch_compile`` (``torch.compile`` of that
module or function) and ``liger`` (Liger-Kernel's, when ``liger_kernel`` is importable; otherwise the
column is skipped with a note). Per implementation: forward ms, forward + backward ms (median of CUDA-event
timings, triton's do_bench; inputs' gradients reset to None each step), peak memory of forward + backward
above the inputs, and the largest difference from ``hf_eager``'s output and gradients relative to their
largest magnitude. Ratios are ``impl ms / polyaccel ms``: above 1 means polyaccel is faster.

Default shapes (Llama-3-8B): hidden 4096, batch 8 x sequence 4096 tokens, 32 query heads and 8 key/value heads
of head_dim 128, rope tables ``[1, S, D]`` (Hugging Face's rotary embedding with one position row).
``--smoke`` runs every section on the CPU at tiny shapes (polyaccel's cpu builders, no torch.compile: the
point is that the script works, not the numbers).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


@dataclass
class Ctx:
    """What every section gets: the device, dtype, shapes and the timer."""

    device: torch.device
    dtype: torch.dtype
    smoke: bool
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float = 1e-5
    tune: bool = False
    profile: bool = False
    vocab: int = 128256

    def time_ms(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]) * 1e3

    def kernel_ms(self, fn: Callable[[], object], calls: int = 5) -> tuple[float | None, list[tuple[str, float]]]:
        """The GPU's kernel time a call (torch.profiler: the kernels' device time summed, host gaps excluded) and
        the kernels by time a call; ``(None, [])`` on the CPU or where the profiler reports no kernels."""
        if self.device.type != "cuda":
            return None, []
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        kernels = [(e.key, e.self_device_time_total / calls / 1e3) for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
        kernels.sort(key=lambda kv: -kv[1])
        return (sum(ms for _, ms in kernels) or None), kernels

    def peak_mb(self, fn: Callable[[], object], leaves=()) -> float | None:
        """Peak memory of ``fn()`` above what is allocated before it, ``leaves``' gradients freed first."""
        if self.device.type != "cuda":
            return None
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20


@dataclass
class Result:
    section: str
    impl: str
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    peak_mb: float | None = None
    max_rel_diff: float | None = None  # vs hf_eager, over outputs and gradients
    note: str = ""
    kernel_ms: float | None = None  # forward + backward: the kernels' device time a call, host gaps excluded
    kernels: list | None = None  # (kernel, ms a call) of forward + backward, with --profile


@functools.cache
def liger():
    """The liger_kernel.transformers module, or None (with the reason printed once)."""
    try:
        import liger_kernel.transformers as lk
    except Exception as exc:  # noqa: BLE001 - any import failure: no Liger column
        print(f"note: liger_kernel is not importable ({type(exc).__name__}: {exc}); the liger column is skipped")
        return None
    return lk


def liger_impl(ctx: Ctx, make: Callable) -> Callable | str:
    """``make(liger_kernel.transformers)`` (the implementation to time), or why there is no Liger row."""
    lk = liger()
    if lk is None:
        return "liger_kernel not installed"
    if ctx.device.type != "cuda":
        return "Liger's Triton kernels need a GPU"
    return make(lk)


def measure(ctx: Ctx, section: str, impls: dict[str, Callable | str], leaves: list[torch.Tensor],
            grads: list[torch.Tensor]) -> list[Result]:
    """Time each ``impls[name]()`` (outputs: a tensor or a tuple) forward and forward + backward.

    A string instead of a callable is a skip note. ``grads`` are the outputs' gradients; each implementation's
    results are compared with ``hf_eager``'s (outputs, then the leaves' gradients). The leaves and gradients are
    restored after each implementation (Liger rotates q and k and writes its dy in place). On a GPU every
    implementation is timed in two passes over all of them and keeps the faster median of each measure, so no
    row gains or loses by its place in the order.
    """
    pristine = [t.detach().clone() for t in (*leaves, *grads)]

    def restore():
        with torch.no_grad():
            for t, saved in zip((*leaves, *grads), pristine, strict=True):
                t.copy_(saved)

    results, timed, want = [], [], None
    for name, forward in impls.items():
        if isinstance(forward, str):
            results.append(Result(section, name, note=forward))
            continue

        def outputs(forward=forward):
            out = forward()
            return out if isinstance(out, tuple) else (out,)

        def fwd_bwd(outputs=outputs):
            for t in leaves:
                t.grad = None
            torch.autograd.backward(outputs(), grads)

        try:
            for t in leaves:
                t.grad = None
            outs = outputs()
            torch.autograd.backward(outs, [g.clone() for g in grads])
            got = [o.detach().float() for o in outs] + [t.grad.float() for t in leaves]
            if name == "hf_eager":
                want = got
            diff = None
            if want is not None:
                diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(
                    got, want, strict=True) if b.numel())
            r = Result(section, name, fwd_ms=ctx.time_ms(outputs), fwd_bwd_ms=ctx.time_ms(fwd_bwd),
                       peak_mb=ctx.peak_mb(fwd_bwd, leaves), max_rel_diff=diff)
            r.kernel_ms, kernels = ctx.kernel_ms(fwd_bwd)
            r.kernels = kernels[:12] if ctx.profile else None
            timed.append((r, outputs, fwd_bwd))
        except Exception as exc:  # noqa: BLE001 - one failing implementation is a row, not the end of the run
            r = Result(section, name, note=f"ERROR {type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
        results.append(r)
        restore()
    if ctx.device.type == "cuda":
        for r, outputs, fwd_bwd in timed:  # the second pass
            r.fwd_ms = min(r.fwd_ms, ctx.time_ms(outputs))
            r.fwd_bwd_ms = min(r.fwd_bwd_ms, ctx.time_ms(fwd_bwd))
            again, _ = ctx.kernel_ms(fwd_bwd)
            r.kernel_ms = min(x for x in (r.kernel_ms, again) if x is not None) if (r.kernel_ms or again) else None
            restore()
    return results


def _compiled(ctx: Ctx, fn):
    if ctx.smoke:
        return "skipped with --smoke (compile time on the CPU)"
    return torch.compile(fn)


# ------------------------------------------------------------------------------ sections
def section_rms_norm(ctx: Ctx) -> list[Result]:
    """RMSNorm of [batch, seq, hidden] (Llama's form, weight of the activations' dtype)."""
    import polyaccel.ops as ops
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    shape = (ctx.batch, ctx.seq, ctx.hidden)
    x = torch.randn(shape, generator=g).to(ctx.device, ctx.dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(ctx.device, ctx.dtype)
    hf = LlamaRMSNorm(ctx.hidden, eps=ctx.eps).to(ctx.device, ctx.dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(ctx.hidden, generator=g) * 0.1 + 1)
    w = hf.weight
    impls: dict[str, Callable | str] = {
        "hf_eager": lambda: hf(x),
        "polyaccel": lambda: ops.rms_norm(x, w, ctx.eps),
        "torch_compile": _compiled(ctx, hf),
    }

    def liger_rms(lk):
        lrms = lk.LigerRMSNorm(ctx.hidden, eps=ctx.eps).to(ctx.device, ctx.dtype)
        lrms.weight = w  # one parameter for all: gradients compared on the same leaf
        return lambda: lrms(x)

    impls["liger"] = liger_impl(ctx, liger_rms)
    ex = impls["torch_compile"]
    if not isinstance(ex, str):
        impls["torch_compile"] = lambda: ex(x)
    results = measure(ctx, "rms_norm", impls, [x, w], [dy])
    if ctx.tune and ctx.device.type == "cuda":
        results += tune_rms_norm(ctx, x.detach(), w.detach(), dy)
    return results


def tune_rms_norm(ctx: Ctx, x, w, dy) -> list[Result]:
    """The Triton kernels alone at other tile configurations (--tune): forward, and backward (x and weight)."""
    from polyaccel.plugins.cuda.kernels import rms_norm as kn

    out = []
    block = triton_next_pow2(ctx.hidden)
    for rows, warps in [kn.tile_config(block, False), (1, 4), (1, 8), (1, 16), (2, 8), (2, 16)]:
        ms = ctx.time_ms(lambda r=rows, nw=warps: kn.rms_norm_forward(x, w, ctx.eps, 0.0, rows_per_step=r,
                                                                      num_warps=nw))
        out.append(Result("rms_norm fwd tune", f"rows={rows} warps={warps}", fwd_ms=ms,
                          note="default" if (rows, warps) == kn.tile_config(block, False) else ""))
    _, rstd = kn.rms_norm_forward(x, w, ctx.eps, 0.0)
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    default = kn.tile_config(block, True)
    for rows, warps in [default, (1, 16), (2, 8), (2, 16), (4, 16), (8, 16)]:
        for per_sm in (1, 2, 4):
            ms = ctx.time_ms(lambda r=rows, nw=warps, p=per_sm: kn.rms_norm_backward(
                dy, x, w, rstd, 0.0, programs=p * sms, rows_per_step=r, num_warps=nw))
            out.append(Result("rms_norm bwd tune", f"rows={rows} warps={warps} programs={per_sm}xSM", fwd_bwd_ms=ms,
                              note="backward kernel + dw reduce" + (" (default tile)" if (rows, warps) == default
                                                                   else "")))
    return out


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def section_rope(ctx: Ctx) -> list[Result]:
    """RoPE of q [B, Hq, S, D] and k [B, Hk, S, D] as Hugging Face makes them (projections viewed
    [B, S, H, D] then transposed), cos/sin from LlamaRotaryEmbedding for one row of positions."""
    import polyaccel.ops as ops
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    B, S, D = ctx.batch, ctx.seq, ctx.head_dim
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, S, ctx.heads, D, generator=g).to(ctx.device, ctx.dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, ctx.kv_heads, D, generator=g).to(ctx.device, ctx.dtype).transpose(1, 2).requires_grad_()
    # the gradients attention's backward hands back: laid out like its inputs ([B, S, H, D] memory)
    gq = torch.randn(B, S, ctx.heads, D, generator=g).to(ctx.device, ctx.dtype).transpose(1, 2)
    gk = torch.randn(B, S, ctx.kv_heads, D, generator=g).to(ctx.device, ctx.dtype).transpose(1, 2)
    cfg = LlamaConfig(hidden_size=ctx.heads * D, num_attention_heads=ctx.heads, num_key_value_heads=ctx.kv_heads,
                      max_position_embeddings=max(S, 2), rope_theta=500000.0)
    rotary = LlamaRotaryEmbedding(cfg).to(ctx.device)
    probe = torch.empty(1, S, 1, device=ctx.device, dtype=ctx.dtype)
    cos, sin = rotary(probe, torch.arange(S, device=ctx.device)[None])

    def hf_rope(q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)

    impls: dict[str, Callable | str] = {
        "hf_eager": lambda: hf_rope(q, k, cos, sin),
        "polyaccel": lambda: ops.rope(q, k, cos, sin),
    }
    ex = _compiled(ctx, hf_rope)
    impls["torch_compile"] = ex if isinstance(ex, str) else (lambda: ex(q, k, cos, sin))
    impls["liger"] = liger_impl(ctx, lambda lk: lambda: lk.liger_rotary_pos_emb(q, k, cos, sin))
    if ctx.tune and ctx.device.type == "cuda":
        impls.update(tune_rope(ctx, q, k, cos, sin))
    return measure(ctx, "rope", impls, [q, k], [gq, gk])


def tune_rope(ctx: Ctx, q, k, cos, sin) -> dict[str, Callable]:
    """The Triton RoPE at other head tiles and warps (--tune), as extra rows of the section."""
    from polyaccel.ops.reference.rope import make_rope
    from polyaccel.plugins.cuda.kernels import rope as kr

    rows = {}
    full = triton_next_pow2(max(ctx.heads, ctx.kv_heads))
    for hq, hk, warps in [(full, triton_next_pow2(ctx.kv_heads), 4), (full, full, 8), (full // 2, full // 2, 4),
                          (full, full, 2)]:
        kw = {"block_hq": hq, "block_hk": hk, "num_warps": warps}
        op = make_rope(functools.partial(kr.rope_forward, **kw), functools.partial(kr.rope_backward, **kw))
        rows[f"tile {hq}/{hk} w{warps}"] = lambda op=op: op(q, k, cos, sin)
    return rows


def section_linear_cross_entropy(ctx: Ctx) -> list[Result]:
    """The LM head and its loss: hidden [batch * seq, hidden] x weight [vocab, hidden] -> the mean cross-entropy
    over the (already shifted) labels, 1 in 8 ignored. Hugging Face's path materialises the bf16 logits and
    their fp32 copy (``lm_head`` then ``ForCausalLMLoss``); Liger's LigerFusedLinearCrossEntropyLoss and
    polyaccel's ``linear_cross_entropy`` go in chunks of tokens. The polyaccel row's note gives its peak memory
    over the others' (the target: <= 0.2x hf_eager's, <= liger's)."""
    import polyaccel.ops as ops
    import torch.nn.functional as F
    from polyaccel.ops import chunked_loss
    from transformers.loss.loss_utils import ForCausalLMLoss

    n, h, v = ctx.batch * ctx.seq, ctx.hidden, ctx.vocab
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(n, h, generator=g)).to(ctx.device, ctx.dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * h ** -0.5).to(ctx.device, ctx.dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.125] = -100
    labels = labels.to(ctx.device)
    one = torch.ones((), device=ctx.device)

    def hf_loss(x, w, labels):
        return ForCausalLMLoss(F.linear(x, w), None, v, shift_labels=labels)

    impls: dict[str, Callable | str] = {
        "hf_eager": lambda: hf_loss(x, w, labels),
        "polyaccel": lambda: ops.linear_cross_entropy(x, w, labels),
        # the same chunk loop with torch's chunk math instead of the Triton kernels (what they gain)
        "torch_chunks": lambda: chunked_loss.linear_cross_entropy(x, w, labels),
    }
    ex = _compiled(ctx, hf_loss)
    impls["torch_compile"] = ex if isinstance(ex, str) else (lambda: ex(x, w, labels))
    impls["liger"] = liger_impl(ctx, lambda lk: functools.partial(lk.LigerFusedLinearCrossEntropyLoss(), w, x,
                                                                    labels))
    if ctx.tune and ctx.device.type == "cuda":
        impls.update(tune_linear_cross_entropy(x, w, labels))
    results = measure(ctx, "linear_cross_entropy", impls, [x, w], [one])
    for r in results:
        if r.impl == "torch_chunks" and not r.note:
            r.note = "polyaccel's chunk loop with torch's chunk math (core's builder)"
    peaks = {r.impl: r.peak_mb for r in results if r.peak_mb}
    mine = next((r for r in results if r.impl == "polyaccel"), None)
    if mine is not None and mine.peak_mb:
        mine.note = "peak " + ", ".join(f"{mine.peak_mb / p:.2f}x {name}'s" for name, p in peaks.items()
                                        if name not in ("polyaccel", "torch_chunks"))
    return results


def tune_linear_cross_entropy(x, w, labels) -> dict[str, Callable]:
    """The Triton chunk kernels at other configurations (--tune): the two-kernel path, and the fused kernel at
    other warps and column blocks (module constants set for the call, then restored)."""
    from polyaccel.ops.chunked_loss import make_linear_cross_entropy
    from polyaccel.plugins.cuda.kernels import cross_entropy as kce

    class TwoKernels:
        stats, grad_, scale_ = kce.TritonChunkKernels.stats, kce.TritonChunkKernels.grad_, kce.TritonChunkKernels.scale_

    rows = {"two kernels": lambda op=make_linear_cross_entropy(TwoKernels): op(x, w, labels)}
    for block, warps in [(16384, 32), (32768, 32), (8192, 16), (16384, 16)]:
        def run(block=block, warps=warps):
            saved = kce.FUSED_BLOCK, kce.FUSED_WARPS
            kce.FUSED_BLOCK, kce.FUSED_WARPS = block, warps
            try:
                return kce.linear_cross_entropy(x, w, labels)
            finally:
                kce.FUSED_BLOCK, kce.FUSED_WARPS = saved
        rows[f"fused b{block} w{warps}"] = run
    return rows


#: section name -> function(ctx) -> list[Result]; run in this order
SECTIONS: dict[str, Callable[[Ctx], list[Result]]] = {
    "rms_norm": section_rms_norm,
    "rope": section_rope,
    "linear_cross_entropy": section_linear_cross_entropy,
}


# ------------------------------------------------------------------------------ report
def _fmt(v, digits=3):
    return "-" if v is None else (f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}")


def print_results(results: list[Result]) -> None:
    ours = {(r.section, "fwd"): r.fwd_ms for r in results if r.impl == "polyaccel"}
    ours.update({(r.section, "both"): r.fwd_bwd_ms for r in results if r.impl == "polyaccel"})
    ours.update({(r.section, "gpu"): r.kernel_ms for r in results if r.impl == "polyaccel"})
    head = f"{'section':<22} {'impl':<14} {'fwd ms':>9} {'x':>6} {'fwd+bwd ms':>11} {'x':>6} {'kernels ms':>10} " \
           f"{'x':>6} {'peak MB':>9} {'max rel diff':>12}  note"
    print(head)
    print("-" * len(head))
    for r in results:
        x_f = x_b = x_k = None
        if r.kernel_ms and ours.get((r.section, "gpu")):
            x_k = r.kernel_ms / ours[(r.section, "gpu")]
        if r.fwd_ms and ours.get((r.section, "fwd")):
            x_f = r.fwd_ms / ours[(r.section, "fwd")]
        if r.fwd_bwd_ms and ours.get((r.section, "both")):
            x_b = r.fwd_bwd_ms / ours[(r.section, "both")]
        print(f"{r.section:<22} {r.impl:<14} {_fmt(r.fwd_ms):>9} {_fmt(x_f):>6} {_fmt(r.fwd_bwd_ms):>11} "
              f"{_fmt(x_b):>6} {_fmt(r.kernel_ms):>10} {_fmt(x_k):>6} {_fmt(r.peak_mb):>9} "
              f"{_fmt(r.max_rel_diff, 2):>12}  {r.note}")
    print("x: the implementation's time over polyaccel's (> 1: polyaccel is faster); kernels ms: forward + "
          "backward's kernels on the GPU a call (profiler), without the host's gaps")
    for r in results:
        if r.kernels:
            print(f"-- {r.section} / {r.impl}: forward + backward kernels, ms a call")
            for name, ms in r.kernels:
                print(f"   {ms:9.3f}  {name[:110]}")


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    p = torch.cuda.get_device_properties(device)
    return f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs)"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    p.add_argument("--json", help="write the results (and the run's metadata) to this file")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=128256, help="the LM head's rows (linear_cross_entropy)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--tune", action="store_true", help="also time the Triton kernels at other tile "
                                                        "configurations (GPU only)")
    p.add_argument("--profile", action="store_true", help="list each implementation's forward + backward kernels "
                                                           "by time (GPU only)")
    args = p.parse_args(argv)
    unknown = [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    return args


def make_ctx(args: argparse.Namespace) -> Ctx:
    dtype = getattr(torch, args.dtype)
    if args.smoke:
        return Ctx(torch.device("cpu"), dtype, True, batch=2, seq=8, hidden=64, heads=4, kv_heads=2, head_dim=16,
                   vocab=96)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA/ROCm GPU (torch.cuda.is_available() is False); use --smoke on the CPU")
    return Ctx(torch.device("cuda", torch.cuda.current_device()), dtype, False, args.batch, args.seq, args.hidden,
               args.heads, args.kv_heads, args.head_dim, vocab=args.vocab, tune=args.tune, profile=args.profile)


def main(argv=None) -> list[Result]:
    args = parse(argv)
    ctx = make_ctx(args)
    results: list[Result] = []
    for name in args.sections.split(","):
        results += SECTIONS[name](ctx)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"device: {_device_name(ctx.device)}; dtype {ctx.dtype}; batch {ctx.batch} x seq {ctx.seq}, hidden "
          f"{ctx.hidden}, heads {ctx.heads}/{ctx.kv_heads} x {ctx.head_dim}")
    print_results(results)
    if args.json:
        import datetime

        import polyaccel.ops as ops

        doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": _device_name(ctx.device), "torch": torch.__version__, "command": " ".join(sys.argv),
               "shapes": {k: getattr(ctx, k) for k in ("batch", "seq", "hidden", "heads", "kv_heads", "head_dim")},
               "dtype": str(ctx.dtype), "builders": {s: ops.registry.chosen(s, ctx.device.type).name
                                                     for s in args.sections.split(",")
                                                     if s in ops.registry.ops()},
               "results": [asdict(r) for r in results]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return results


if __name__ == "__main__":
    main()
