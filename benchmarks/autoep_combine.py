"""How AutoEP's combine should apply the router weights: ways of ``out[t] = sum_j w[t, j] * rows[t, j]``
timed on the device (forward only: ``CombineRows`` has its own backward), over the shapes of
``autoep_gpu.py`` (bf16, H 2048).

    python benchmarks/autoep_combine.py [--hidden 2048] [--tokens 4096 32768] [--topk 2 8]

``rows`` is ``[T, k, H]`` (the routed rows already back in token order), ``w`` is ``[T, k]``; each way is
checked against a float64 product first. The way ``CombineRows`` uses should be the fastest in every row.
The last two columns are the unweighted sum over k (the dispatch's backward, and a combine without
weights): a reduction over the middle dimension, and ``_sum_slots``.
"""

from __future__ import annotations

import argparse

import torch


def by_bmm(rows, w):
    return torch.bmm(w.unsqueeze(1), rows).squeeze(1)


def by_slots(rows, w):
    out = rows[:, 0] * w[:, :1]
    for j in range(1, rows.shape[1]):
        out = torch.addcmul(out, rows[:, j], w[:, j:j + 1])
    return out


def by_broadcast(rows, w):
    return (rows * w.unsqueeze(-1)).sum(dim=1)


def plain_sum(rows, w):  # the unweighted sum over k (the dispatch's backward), as a reduction
    return rows.sum(dim=1)


def plain_slots(rows, w):  # and slot by slot, as CombineRows does up to k = 3
    from polyaccel.engines.autoep.permute import _sum_slots

    return _sum_slots(rows)


WAYS = {"bmm [1,k]x[k,H]": by_bmm, "slot by slot": by_slots, "broadcast + sum": by_broadcast}
SUMS = {"sum(dim=1)": plain_sum, "_sum_slots": plain_slots}  # unweighted: the weights are ignored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--topk", type=int, nargs="+", default=[2, 8])
    args = ap.parse_args()
    from benchlib import require_gpu, time_ms

    device = require_gpu()
    print(f"{'T':>6s} {'k':>2s} " + " ".join(f"{name:>18s}" for name in {**WAYS, **SUMS}) + "   (ms)")
    for T in args.tokens:
        for k in args.topk:
            rows = torch.randn(T, k, args.hidden, device=device, dtype=torch.bfloat16)
            w = torch.rand(T, k, device=device, dtype=torch.bfloat16)
            ref = by_bmm(rows.double(), w.double())
            times = []
            for fn in [*WAYS.values(), *SUMS.values()]:
                want = ref if fn in WAYS.values() else rows.double().sum(dim=1)
                err = (fn(rows, w).double() - want).abs().max().item()
                assert err < 0.1, f"{fn.__name__}: max abs error {err}"
                times.append(time_ms(lambda fn=fn, rows=rows, w=w: fn(rows, w)))
            print(f"{T:6d} {k:2d} " + " ".join(f"{t:18.3f}" for t in times))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
