"""Triton logprobs, entropy and kl under TRITON_INTERPRET=1: against the float64 reference, and vocab-parallel
over 2 gloo ranks (uneven shards) against the unsplit op."""

from __future__ import annotations

import pytest
import torch
from polyaccel.ops import reference as ref
from polyaccel.plugins.cuda.kernels import logits_ops as lo
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # masked -inf lanes

OPS = ("logprobs", "entropy", "kl")


def _call(module, op, p, q, labels, **kw):
    if op == "logprobs":
        return module.logprobs(p, labels, **kw)
    return module.entropy(p, **kw) if op == "entropy" else module.kl(p, q, **kw)


def _grads(module, op, zp, zq, labels, go, **kw):
    p, q = zp.clone().requires_grad_(True), zq.clone().requires_grad_(True)
    out = _call(module, op, p, q, labels, **kw)
    out.backward(go.to(out.dtype))
    return out.detach().double(), p.grad.double(), None if q.grad is None else q.grad.double()


#: shapes [..., V]: a row over two column blocks (the second partial), a batch, one class, no rows
SHAPES = [(3, lo.BLOCK_V + 77), (2, 3, 130), (4, 1), (0, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_ops_match_the_float64_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        zp = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
        zq = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
        labels = torch.randint(0, shape[-1], shape[:-1], generator=gen)
        go = torch.randn(shape[:-1], generator=gen, dtype=torch.float64)
        for op in OPS:
            got = _grads(lo, op, zp, zq, labels, go)
            want = _grads(ref, op, zp.double(), zq.double(), labels, go)
            assert got[0].dtype == torch.float64 and _call(lo, op, zp, zq, labels).dtype == (
                torch.float64 if dtype == torch.float64 else torch.float32)
            # inputs exact in float64; the kernels' fp32 math errs ~1e-6 of the row's largest logits, and 16-bit
            # gradients are one rounding off
            tol = 1e-11 if dtype == torch.float64 else (1e-4 if dtype == torch.float32 else 3e-2)
            for a, b, what in zip(got, want, ("out", "d p", "d q"), strict=True):
                if a is None or b is None:
                    assert op != "kl" or what != "d q", f"{op}: no gradient for logits_q"
                    continue
                if a.numel():
                    err = float((a - b).abs().max())
                    assert err <= tol * max(1.0, float(b.abs().max())), f"{op} {dtype} {shape} {what}: {err:.3e}"


def _ranks(rank, world_size):
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch.distributed as dist
    from polyaccel.plugins.cuda.kernels import logits_ops

    v, split = 23, (16, 7)
    lo_col = sum(split[:rank])
    cols = slice(lo_col, lo_col + split[rank])
    gen = torch.Generator().manual_seed(9)
    zp = torch.randn(5, v, generator=gen, dtype=torch.float64) * 3
    zq = torch.randn(5, v, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, v, (5,), generator=gen)
    go = torch.randn(5, generator=gen, dtype=torch.float64)
    errs = {}
    for op in OPS:
        whole = _grads(logits_ops, op, zp, zq, labels, go)
        part = _grads(logits_ops, op, zp[:, cols], zq[:, cols], labels, go, group=dist.group.WORLD)
        errs[op] = [float((part[0] - whole[0]).abs().max()), float((part[1] - whole[1][:, cols]).abs().max())]
        if op == "kl":
            errs[op].append(float((part[2] - whole[2][:, cols]).abs().max()))
    return errs


def test_vocab_parallel_on_two_ranks_equals_the_unsplit_op():
    for errs in run_ranks(_ranks, 2, timeout=120, env={"TRITON_INTERPRET": "1"}):
        assert set(errs) == set(OPS)
        assert all(max(e) < 1e-12 for e in errs.values()), errs


def test_the_builders_are_registered_for_cuda():
    from polyaccel.plugins.cuda import ops as cuda_ops

    rows = {b.op: b for b in cuda_ops.builders(OPS)}
    assert set(rows) == set(OPS)
    assert all(rows[op].load() is getattr(lo, op) and rows[op].kind == "triton" for op in OPS)
