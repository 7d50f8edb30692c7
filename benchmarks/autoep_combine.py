"""AutoEP's combine and its dispatch's backward on the device: torch ops against the op registry's
``gather_sum`` (whichever builder serves the device), over the shapes of ``autoep_gpu.py`` (bf16, H 2048).

    python benchmarks/autoep_combine.py [--hidden 2048] [--tokens 4096 32768] [--topk 1 2 3 8]

``y [T*k, H]`` holds the experts' rows in expert order (a random expert-major routing), ``w [T, k]`` the router
weights. Columns, in ms:

- combine forward: gather into token order then weight and sum (slot by slot up to k = 3, one batched
  product above: what AutoEP ran before ``gather_sum``), against ``gather_sum(y, index, w)``;
- combine forward + backward: the above plus its backward (gather ``grad_out`` per slot, multiply by the
  weights, a batched dot product for the weights' gradient), against ``gather_sum`` forward and backward;
- dispatch backward: the ``[T*k, H]`` gradient of the routed rows gathered per slot then ``sum(dim=1)``,
  against ``gather_sum(grad, index)``.

Each way is checked against float64 first.
"""

from __future__ import annotations

import argparse

import torch


def torch_combine_forward(y, w, inverse, k):
    per_slot = y.index_select(0, inverse).view(-1, k, y.shape[-1])
    if k > 3:
        return torch.bmm(w.unsqueeze(1), per_slot).squeeze(1), per_slot
    out = per_slot[:, 0] * w[:, :1]
    for j in range(1, k):
        out.addcmul_(per_slot[:, j], w[:, j:j + 1])
    return out, per_slot


def torch_combine(y, w, order, inverse, k, grad):
    out, per_slot = torch_combine_forward(y, w, inverse, k)
    d_y = grad.index_select(0, torch.div(order, k, rounding_mode="floor"))
    d_y.mul_(w.reshape(-1).index_select(0, order).unsqueeze(-1))
    d_w = torch.bmm(per_slot, grad.unsqueeze(-1)).squeeze(-1)
    return out, d_y, d_w


def op_combine(y, w, order, inverse, k, grad):
    from polyaccel import ops

    y, w = y.detach().requires_grad_(True), w.detach().requires_grad_(True)
    out = ops.gather_sum(y, inverse.view(-1, k), w)
    return (out, *torch.autograd.grad(out, (y, w), grad))


def torch_dispatch_backward(grad, inverse, k):
    return grad.index_select(0, inverse).view(-1, k, grad.shape[-1]).sum(dim=1)


def op_dispatch_backward(grad, inverse, k):
    from polyaccel import ops

    return ops.gather_sum(grad, inverse.view(-1, k))


def _routing(T, k, E, device):
    from polyaccel.engines.autoep.permute import inverse_permutation

    experts = torch.rand(T, E, device=device).topk(k, dim=-1)[1]
    order = torch.argsort(experts.reshape(-1), stable=True)
    return order, inverse_permutation(order)


def _check(got, want, what):
    err = max((g.double() - r).abs().max().item() / max(r.abs().max().item(), 1.0)
              for g, r in zip(got, want, strict=True))
    assert err < 0.05, f"{what}: max relative error {err}"


def _times(T: int, k: int, hidden: int, experts: int, device) -> list[float]:
    """One row of the table: every way checked against float64, then timed (ms)."""
    from benchlib import time_ms
    from polyaccel import ops

    order, inverse = _routing(T, k, experts, device)
    y = torch.randn(T * k, hidden, device=device, dtype=torch.bfloat16)
    w = torch.rand(T, k, device=device, dtype=torch.bfloat16)
    grad = torch.randn(T, hidden, device=device, dtype=torch.bfloat16)
    y64, w64, g64 = y.double().requires_grad_(True), w.double().requires_grad_(True), grad.double()
    out64 = torch.einsum("tk,tkh->th", w64, y64[inverse].view(T, k, -1))
    want = (out64.detach(), *torch.autograd.grad(out64, (y64, w64), g64))
    for fn in (torch_combine, op_combine):
        _check(fn(y, w, order, inverse, k, grad), want, fn.__name__)
    routed_grad = torch.randn(T * k, hidden, device=device, dtype=torch.bfloat16)  # the dispatch's grad_out
    want_dispatch = routed_grad.double().index_select(0, inverse).view(T, k, -1).sum(1)
    for fn in (torch_dispatch_backward, op_dispatch_backward):
        _check([fn(routed_grad, inverse, k)], [want_dispatch], fn.__name__)
    return [
        time_ms(lambda: torch_combine_forward(y, w, inverse, k)),
        time_ms(lambda: ops.gather_sum(y, inverse.view(T, k), w)),
        time_ms(lambda: torch_combine(y, w, order, inverse, k, grad)),
        time_ms(lambda: op_combine(y, w, order, inverse, k, grad)),
        time_ms(lambda: torch_dispatch_backward(routed_grad, inverse, k)),
        time_ms(lambda: op_dispatch_backward(routed_grad, inverse, k)),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--topk", type=int, nargs="+", default=[1, 2, 3, 8])
    args = ap.parse_args()
    from benchlib import require_gpu
    from polyaccel import ops

    device = require_gpu()
    print(f"gather_sum builder: {ops.registry.chosen('gather_sum', device.type).name}")
    heads = ["fwd torch", "fwd gather_sum", "fwd+bwd torch", "fwd+bwd gather_sum", "dispatch bwd torch",
             "dispatch bwd gather_sum"]
    print(f"{'T':>6s} {'k':>2s} " + " ".join(f"{h:>23s}" for h in heads) + "   (ms)")
    for T in args.tokens:
        for k in args.topk:
            times = _times(T, k, args.hidden, args.experts, device)
            print(f"{T:6d} {k:2d} " + " ".join(f"{t:23.3f}" for t in times))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
