"""The host's time (Python and dispatch) of one forward + backward of AutoEP's MoE layer, on the CPU at tiny sizes.

    python benchmarks/autoep_host_cpu.py [--steps 2000] [--experts 8 --tokens 64 --topk 2 --hidden 64 --ffn 32]
                                         [--profile N] [--tree DIR]

At these sizes a kernel's work is negligible, so a step's time is what the host spends on it: the layer's
Python (routing, sorting, the op registry, the builders' wrappers, the autograd nodes' forward and backward)
and the dispatch of each aten op. A step with few tokens a layer on a GPU is bound by that same work
(``autoep_gpu.py``'s 4k-token top-2 rows), so this is where it can be cut without a GPU. Printed: us a step, the
median of ``--steps`` steps, wall and the thread's CPU time (the latter steadier on a shared machine), for
the builders ``--builders`` names:

- ``cuda`` (default): the layer as it runs on a GPU by default, the cuda plugin's ``torch_moe_gate_up`` /
  ``torch_moe_down_combine`` builders, with their Triton launches made no-ops (``TRITON_INTERPRET=1`` would
  run them in Python for milliseconds) and ``torch._grouped_mm`` an empty result of its shape (its CPU
  fallback is slow; on a GPU both are a driver launch). Outputs are then not the layer's numbers: this row
  measures the host's time only, launches excluded.
- ``cpu``: the layer on the cpu plugin's builders (the unfused chain through the references).

``--profile N`` prints cProfile's top N functions (own time) of the step. ``--tree DIR`` runs
the polyaccel sources under DIR instead of this checkout's (e.g. a ``git archive`` of an earlier commit),
to compare two versions on one machine: run both, alternating.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported


def use_tree(root: str) -> None:
    """Import polyaccel from the source tree ``root`` (an editable install's mapping, redirected)."""
    import importlib

    for mod in list(sys.meta_path):
        mapping = getattr(sys.modules.get(getattr(mod, "__module__", ""), None), "MAPPING", None)
        if isinstance(mapping, dict) and "polyaccel" in mapping:
            old = mapping["polyaccel"].rsplit("/", 1)[0]
            for key, path in list(mapping.items()):
                mapping[key] = path.replace(old, os.path.abspath(root), 1)
            importlib.invalidate_caches()
            return
    raise SystemExit("--tree: polyaccel is not an editable install here")


def stub_device_work() -> None:
    """Make every interpreted Triton launch return at once (the kernels' outputs stay unwritten), and
    ``torch._grouped_mm`` return an unwritten result of its shape (its CPU fallback takes ~150 us a call
    at these sizes, where a GPU launch takes a few)."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    InterpretedFunction.run = lambda self, *args, grid, warmup, **kwargs: None

    def grouped_mm_shape(a, b, offs=None, bias=None, out_dtype=None):
        if a.dim() == 2 and b.dim() == 2:  # [K, M] x [M, N] -> [groups, K, N]
            return a.new_empty((offs.numel(), a.shape[0], b.shape[1]))
        return a.new_empty((a.shape[0], b.shape[-1]))

    torch._grouped_mm = grouped_mm_shape


def step_of(block, x, g):
    def fn():
        for p in block.parameters():
            p.grad = None
        out = block(x.detach().requires_grad_(True))
        out = out[0] if isinstance(out, tuple) else out
        (out.float() * g).sum().backward()
    return fn


def step_us(fn, steps: int, warmup: int = 50) -> tuple[float, float]:
    """(median wall us, median CPU us of this thread) a call of ``fn`` over ``steps`` calls. The thread's CPU time
    leaves out the time other processes take the core for (a shared machine), the wall time does not."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(wall) * 1e6, statistics.median(cpu) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=32)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--builders", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)
    if args.tree:
        use_tree(args.tree)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

    import torch

    torch.set_num_threads(1)
    import polyaccel
    from autoep_gpu import autoep_block, hf_block
    from autoep_launches import CudaKernelsOnCpu

    E, k, H, F, T = args.experts, args.topk, args.hidden, args.ffn, args.tokens
    device = torch.device("cpu")
    eager = hf_block(E, k, H, F, "eager", device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, H, generator=gen).to(torch.bfloat16)
    g = torch.randn(1, T, H, generator=gen)
    print(f"E={E} T={T} k={k} H={H} F={F} bf16, one forward + backward, {args.steps} steps"
          + (f" [{args.tree}]" if args.tree else ""))

    if args.builders == "cuda":
        polyaccel.register_plugin("cuda_kernels_on_cpu", CudaKernelsOnCpu())
        stub_device_work()
    step = step_of(autoep_block(eager), x, g)
    from polyaccel import ops

    names = [getattr(ops.resolve(op, "cpu"), "__module__", "?") for op in ("moe_gate_up", "moe_down_combine")]
    wall, cpu = step_us(step, args.steps)
    print(f"  {args.builders} builders (moe_gate_up / moe_down_combine from {', '.join(sorted(set(names)))}): "
          f"{wall:.1f} us/step wall, {cpu:.1f} us/step CPU")
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
