"""The loss ops over a vocabulary split across 2 gloo ranks equal the unsplit ops in float64 (loss and gradients).

One launch checks: linear_cross_entropy through polyaccel.ops (the chunked builder) and the reference,
even and uneven shards, vocab_start given or derived, z-loss, ignored labels, a bias; logprobs, entropy
and kl with their gradients; and the contract's refusals of inconsistent shards and row counts.
"""

from __future__ import annotations

import torch
from polyaccel.testing.multiprocess import run_ranks

N, H = 13, 6


def _full(v: int):
    gen = torch.Generator().manual_seed(v)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, H, generator=gen, dtype=torch.float64)
    bias = torch.randn(v, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (N,), generator=gen)
    labels[::3] = -100
    return hidden, weight, bias, labels


def _lce(fn, hidden, weight, bias, labels, **kw):
    h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
    loss = fn(h, w, labels, bias=b, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad, b.grad


def _ranks(rank, world_size):
    import torch.distributed as dist
    from polyaccel import ops
    from polyaccel.errors import OpArgumentError
    from polyaccel.ops import reference as ref

    group = dist.group.WORLD
    out = {}
    for v, split in ((20, (10, 10)), (23, (16, 7))):
        hidden, weight, bias, labels = _full(v)
        lo = sum(split[:rank])
        rows = slice(lo, lo + split[rank])
        for name, fn in (("ops", ops.linear_cross_entropy), ("reference", ref.linear_cross_entropy)):
            for kw in ({}, {"z_loss": 0.01, "chunk_size": 4}, {"reduction": "sum", "vocab_start": lo}):
                want = _lce(fn, hidden, weight, bias, labels, **{k: x for k, x in kw.items() if k != "vocab_start"})
                got = _lce(fn, hidden, weight[rows], bias[rows], labels, group=group, **kw)
                # hidden's gradient is the shard's part: summed over the group it is the whole one
                dh = got[1].clone()
                dist.all_reduce(dh)
                key = f"{name} V={v} {split} {kw}"
                out[key] = [float((got[0] - want[0]).abs()), float((dh - want[1]).abs().max()),
                            float((got[2] - want[2][rows]).abs().max()), float((got[3] - want[3][rows]).abs().max())]
        zp = torch.randn(4, 3, v, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        zq = torch.randn(4, 3, v, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        lab = torch.randint(0, v, (4, 3), generator=torch.Generator().manual_seed(3))
        go = torch.randn(4, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        for op in ("logprobs", "entropy", "kl"):
            res = []
            for shard in (False, True):
                p = (zp[..., rows] if shard else zp).clone().requires_grad_(True)
                q = (zq[..., rows] if shard else zq).clone().requires_grad_(True)
                g = {"group": group} if shard else {}
                if op == "logprobs":
                    o = ops.logprobs(p, lab, **g)
                else:
                    o = ops.entropy(p, **g) if op == "entropy" else ops.kl(p, q, **g)
                o.backward(go)
                res.append((o.detach(), p.grad, q.grad))
            (w, wp, wq), (s, sp, sq) = res
            errs = [float((s - w).abs().max()), float((sp - wp[..., rows]).abs().max())]
            if op == "kl":
                errs.append(float((sq - wq[..., rows]).abs().max()))
            out[f"{op} V={v} {split}"] = errs
    refusals = []
    hidden, weight, bias, labels = _full(20)
    for kw, rows_n in (({"vocab_start": 0}, N), ({"vocab_start": [0, 12][rank]}, N), ({}, N - rank)):
        try:
            ops.linear_cross_entropy(hidden[:rows_n], weight[:10], labels[:rows_n], group=group, **kw)
        except OpArgumentError as exc:
            refusals.append(str(exc))
    return out, refusals


def test_vocab_parallel_equals_the_unsplit_ops_in_float64():
    for out, refusals in run_ranks(_ranks, 2, timeout=120):
        bad = {k: v for k, v in out.items() if not max(v) < 1e-11}
        assert not bad, f"vocab-parallel results differ from the unsplit ones: {bad}"
        assert len(out) == 2 * (2 * 3 + 3)
        assert len(refusals) == 3, refusals
        assert "overlap" in refusals[0] and "gap" in refusals[1] and "different numbers of rows" in refusals[2]
