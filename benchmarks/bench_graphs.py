"""An optimizer step captured in a CUDA graph and replayed, vs the same step run eagerly.

    python benchmarks/bench_graphs.py [--tensors 400] [--params 8e6]

Small models are where launch and host overhead dominate, so this uses many small tensors.
The captured step is ``step.add_(1)`` plus the Triton ``fused_adam`` reading the step from the
device; replays must equal the same number of eager steps bit for bit (checked here), which
proves the step count advances inside the graph. torch's ``AdamW(foreach=True, capturable=True)``
is shown eager and captured for scale. Graphs go through the accelerator API
(``create_graph`` / ``capture_to_graph`` / ``replay_graph``).
"""

from __future__ import annotations

import argparse

import benchlib
import torch
from benchlib import Row, time_ms

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _model(n_tensors: int, total: int, device):
    g = torch.Generator().manual_seed(1)
    w = torch.rand(n_tensors, generator=g) + 0.05
    sizes = [max(1, int(x)) for x in (w / w.sum() * total)]
    params = [torch.randn(s, device=device) for s in sizes]
    grads = [torch.randn(s, device=device) for s in sizes]
    return params, grads


def _capture(acc, fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = acc.create_graph()
    with acc.capture_to_graph(graph):
        fn()
    return graph


def main(argv=None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=400)
    ap.add_argument("--params", type=float, default=8e6)
    args = ap.parse_args(argv or [])
    device = benchlib.require_gpu()
    from polyaccel.plugins.cuda.accelerator import CudaAccelerator
    from polyaccel.plugins.cuda.kernels.optimizers import fused_adam

    acc = CudaAccelerator()
    acc.require("graphs")
    params, grads = _model(args.tensors, int(args.params), device)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    step = torch.zeros((), device=device)

    def ours():
        step.add_(1)
        fused_adam(params, grads, m, v, step=step, **HP)

    eager_ms = time_ms(ours)
    graph = _capture(acc, ours)
    replay_ms = time_ms(lambda: acc.replay_graph(graph))

    # correctness: K replays == K eager steps, bit for bit, from the same state
    snap = [[t.clone() for t in lst] for lst in (params, m, v)] + [step.clone()]
    k = 5
    for _ in range(k):
        acc.replay_graph(graph)
    replayed = [[t.clone() for t in lst] for lst in (params, m, v)] + [step.clone()]
    for dst, src in zip((params, m, v), snap[:3], strict=True):
        torch._foreach_copy_(dst, src)
    step.copy_(snap[3])
    for _ in range(k):
        ours()
    torch.cuda.synchronize()
    pairs = [(a, b) for la, lb in zip(replayed[:3], (params, m, v), strict=True) for a, b in zip(la, lb, strict=True)]
    same = all(torch.equal(a, b) for a, b in pairs)
    same = same and torch.equal(replayed[3], step)
    changed = not all(torch.equal(a, b) for a, b in zip(snap[0], params, strict=True))

    # torch's capturable foreach AdamW, eager and captured, for scale
    tp = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(tp, grads, strict=True):
        p.grad = g
    opt = torch.optim.AdamW(tp, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], foreach=True, capturable=True)
    t_eager = time_ms(opt.step)
    tgraph = _capture(acc, opt.step)
    t_replay = time_ms(lambda: acc.replay_graph(tgraph))

    n = sum(p.numel() for p in params)
    case = f"FusedAdam step, {n / 1e6:.1f}M params / {len(params)} tensors"
    return [
        Row("graphs", f"{case}: graph replay vs eager", "ms", "eager (ours)", eager_ms, replay_ms,
            target="replay == eager bit for bit; faster", met=same and changed and replay_ms < eager_ms,
            detail=f"{k} replays vs {k} eager steps: {'bitwise equal' if same else 'DIFFERENT'}"
                   f"{'' if changed else ', params did not change'}"),
        Row("graphs", "torch AdamW(foreach, capturable), same model: graph vs eager", "ms", "torch eager",
            t_eager, t_replay, detail=f"ours captured vs torch captured: {t_replay / replay_ms:.2f}x"),
    ]


if __name__ == "__main__":
    benchlib.run_standalone(main)
