"""Kernel launches and host syncs of one forward + backward of AutoEP's MoE layer and of the HF blocks (bf16, ep 1).

    python benchmarks/autoep_launches.py [--experts 8] [--tokens 64] [--topk 2] [--hidden 64] [--ffn 32]

Counted at the dispatcher (``polyaccel.testing.launches``), so it runs on the CPU and says what a GPU
step launches; beside it, the autograd nodes the step's backward runs (each a call into the engine
on the host, the Python ``autograd.Function`` ones through the interpreter). The cuda plugin's
expert builders stand in for the cpu plugin's (their Triton kernels under ``TRITON_INTERPRET=1``,
hence the small default sizes). Rows: AutoEP as it runs on a GPU by default (the ``torch_moe_*``
builders of ``moe_gate_up`` / ``moe_down_combine``), AutoEP on the unfused ops
(``fused_experts=False``: ``grouped_mm`` -> ``swiglu`` -> ``grouped_mm`` -> ``gather_sum``),
transformers' grouped_mm experts and its eager expert loop. Where the host bounds a step (few tokens
a layer: the 4k-token, top-2 rows of ``autoep_gpu.py``), its time follows these counts.

``syncs`` counts the ops that read device values back to the host (``polyaccel.testing.launches``:
``.item()``, ``nonzero``, data-dependent sizes ...): on a GPU each waits for everything queued, so
the host loses its lead over the device there. AutoEP's default path has none at fixed shapes; the
eager HF loop reads which experts were hit.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import importlib  # noqa: E402

import torch  # noqa: E402
from polyaccel.hookspecs import hookimpl  # noqa: E402

#: op -> (kernel module of the cuda plugin, function): the builders a GPU step runs
CUDA_BUILDERS = {"grouped_mm": ("grouped_mm", "torch_grouped_mm"), "swiglu": ("swiglu", "swiglu"),
                 "gather_sum": ("gather_sum", "gather_sum"), "moe_gate_up": ("moe_grouped", "moe_gate_up"),
                 "moe_down_combine": ("moe_grouped", "moe_down_combine")}


class CudaKernelsOnCpu:
    """A plugin serving the cpu device with the cuda plugin's builders of the expert ops."""

    POLYACCEL_API_VERSION = "1.0"

    @hookimpl
    def polyaccel_register_ops(self, registry):
        for op, (module, attr) in CUDA_BUILDERS.items():
            mod = importlib.import_module(f"polyaccel.plugins.cuda.kernels.{module}")
            registry.register(op, f"cuda_{attr}_on_cpu", ("cpu",), lambda m=mod, a=attr: getattr(m, a), priority=1000)


def backward_nodes(block, x, grad) -> tuple[int, int]:
    """(autograd nodes a step's backward runs, of which Python ``autograd.Function`` nodes): each is a call into the
    engine on the host, the Python ones through the interpreter."""
    out = block(x.detach().requires_grad_(True))
    out = out[0] if isinstance(out, tuple) else out
    loss = (out.float() * grad).sum()
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return len(seen), sum(isinstance(n, torch.autograd.function.BackwardCFunction) for n in seen)


def count_step(block, x, grad):
    from autoep_gpu import train_step
    from polyaccel.testing.launches import Launches

    step = train_step(block, x, grad)
    step()  # (first calls compile and cache)
    with Launches() as counted:
        step()
    return counted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=32)
    args = ap.parse_args(argv)

    import polyaccel
    from autoep_gpu import autoep_block, hf_block

    polyaccel.register_plugin("cuda_kernels_on_cpu", CudaKernelsOnCpu())
    device = torch.device("cpu")
    E, k, H, F, T = args.experts, args.topk, args.hidden, args.ffn, args.tokens
    eager = hf_block(E, k, H, F, "eager", device)
    blocks = {"AutoEP (default: torch_moe_*)": autoep_block(eager),
              "AutoEP (unfused ops)": autoep_block(eager, fused=False),
              "HF grouped_mm": hf_block(E, k, H, F, "grouped_mm", device),
              "HF eager": eager}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, H, generator=g).to(torch.bfloat16)
    grad = torch.randn(1, T, H, generator=g)
    print(f"E={E} T={T} k={k} H={H} F={F} bf16, one forward + backward (loss (out * g).sum())")
    for name, block in blocks.items():
        c = count_step(block, x, grad)
        nodes, python = backward_nodes(block, x, grad)
        syncs = sum(c.syncs.values())
        print(f"{name:30s} aten {c.total:3d}  triton {sum(c.triton.values()):2d}  syncs {syncs:2d}  backward nodes "
              f"{nodes:3d} ({python} Python)  ({', '.join(f'{op} {n}' for op, n in c.ops.most_common())})"
              + (f"  [syncs: {', '.join(f'{op} {n}' for op, n in c.syncs.most_common())}]" if syncs else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
