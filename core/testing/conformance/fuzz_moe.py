"""The op fuzz suite's strategies and runners for ``moe_gate_up`` and ``moe_down_combine``.

Drawn: strided and offset layouts of every tensor (the weights too: AutoEP passes transposed
views), experts without rows, rows past the last offset, one or several slots per token, int32 or
int64 index and offsets, weighted or not. The reference runs on float64 host copies; results and
gradients are judged against the same chain on absolute values (the dot products' error bound),
and every input must come back unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import polyaccel.ops as ops
import torch
from hypothesis import strategies as st
from polyaccel.ops import reference as ref

from .fuzz_layouts import Buffers, Layout, TensorSpec, draw_layout, dtype_name, host64
from .fuzz_outcome import COMPARED, REFUSED, attempt, close, fail, pretty_repr, unchanged

SEEDS = st.integers(0, 2**31 - 1)


@dataclass(frozen=True)
class MoeCase:
    """One call of either op: ``tokens`` x ``k`` slots routed over experts with ``counts`` rows (plus a tail)."""

    op: str
    tokens: int
    k: int
    counts: tuple[int, ...]
    rows_in: TensorSpec  # x [T, H] for moe_gate_up, h [N, F] for moe_down_combine
    weight: TensorSpec
    weights: TensorSpec | None
    int_dtype: torch.dtype
    seed: int

    def __repr__(self) -> str:
        w = repr(self.weights) if self.weights is not None else "weights: None"
        return (f"{self.op} | tokens {self.tokens} k {self.k} rows per expert {list(self.counts)} | {self.rows_in!r} "
                f"| {self.weight!r} | {w} | index/offsets {dtype_name(self.int_dtype)} | seed {self.seed}")

    _repr_pretty_ = pretty_repr


def _draw(draw, op: str, dtypes) -> MoeCase:
    dtype = draw(st.sampled_from(dtypes))
    t, k = draw(st.integers(0, 5)), draw(st.integers(1, 3))
    n = t * k
    e = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=e, max_size=e)))
    counts = tuple(b - a for a, b in zip([0] + cuts[:-1], cuts, strict=True))  # the rest: past the last offset
    h, f = draw(st.integers(1, 9)), draw(st.integers(1, 6))
    if op == "moe_gate_up":
        rows_in = TensorSpec("x", draw_layout(draw, (t, h)), dtype)
        weight = TensorSpec("weight", draw_layout(draw, (e, h, 2 * f)), dtype)
        weights = None
    else:
        rows_in = TensorSpec("h", draw_layout(draw, (n, f)), dtype)
        weight = TensorSpec("weight", draw_layout(draw, (e, f, h)), dtype)
        weights = (TensorSpec("weights", draw_layout(draw, (t, k)), draw(st.sampled_from(dtypes)))
                   if draw(st.booleans()) else None)
    return MoeCase(op, t, k, counts, rows_in, weight, weights, draw(st.sampled_from((torch.int64, torch.int32))),
                   draw(SEEDS))


@st.composite
def moe_gate_up_cases(draw, dtypes: tuple[torch.dtype, ...]) -> MoeCase:
    return _draw(draw, "moe_gate_up", dtypes)


@st.composite
def moe_down_combine_cases(draw, dtypes: tuple[torch.dtype, ...]) -> MoeCase:
    return _draw(draw, "moe_down_combine", dtypes)


def run_moe(case: MoeCase, device: torch.device) -> str:
    bufs = Buffers(device, torch.Generator().manual_seed(case.seed))
    t, k = case.tokens, case.k
    a = bufs.make(case.rows_in).detach().requires_grad_(True)
    w = bufs.make(case.weight, scale=0.5).detach().requires_grad_(True)
    perm = torch.randperm(t * k, generator=bufs.generator).view(t, k).double()
    index = bufs.make(TensorSpec("index", Layout.contiguous((t, k)), case.int_dtype), values=perm)
    ends = torch.tensor(case.counts, dtype=torch.float64).cumsum(0)
    offsets = bufs.make(TensorSpec("offsets", Layout.contiguous((len(case.counts),)), case.int_dtype), values=ends)
    weights = None
    if case.weights is not None:
        weights = bufs.make(case.weights, positive=True).detach().requires_grad_(True)
    out_rows, out_cols = (t * k, case.weight.layout.shape[2] // 2) if case.op == "moe_gate_up" else (
        t, case.weight.layout.shape[2])
    grad_out = bufs.make(TensorSpec("grad_out", Layout.contiguous((out_rows, out_cols)), case.rows_in.dtype))

    if case.op == "moe_gate_up":
        call = lambda: ops.moe_gate_up(a, index, w, offsets)  # noqa: E731
    else:
        call = lambda: ops.moe_down_combine(a, w, offsets, index, weights)  # noqa: E731

    def both():
        out = call()
        out.backward(grad_out)
        return out

    outcome, out = attempt(both, bufs)
    if outcome == REFUSED:
        return f"{REFUSED}: {bufs.refusal}"
    unchanged(bufs, {e[0] for e in bufs.entries})
    idx, off = perm.long(), ends.long()

    def reference(absolute: bool):
        lv = [host64(a), host64(w)] + ([host64(weights)] if weights is not None else [])
        lv = [(v.abs() if absolute else v).requires_grad_(True) for v in lv]
        if case.op == "moe_gate_up":
            # SwiGLU is not monotone: on absolute values the chain still bounds the GEMM's rounding
            o = ref.moe_gate_up(lv[0], idx, lv[1], off)
        else:
            o = ref.moe_down_combine(lv[0], lv[1], off, idx, lv[2] if weights is not None else None)
        go = host64(grad_out)
        o.backward(go.abs() if absolute else go)
        return o, lv

    want, lv = reference(False)
    mag, lv_abs = reference(True)
    dtype = case.rows_in.dtype
    if out.dtype != dtype:
        fail(f"result is {out.dtype}, expected {dtype}")
    close(out, want, dtype, "forward", mag=mag.detach().abs() + want.detach().abs())
    names = [case.rows_in.role, "weight"] + (["weights"] if weights is not None else [])
    for name, got, w64, m64 in zip(names, [a, w, weights], lv, lv_abs, strict=False):
        if got.grad is None:
            fail(f"backward produced no gradient for {name}")
        gdtype = dtype
        if name == "weights" and torch.finfo(case.weights.dtype).eps > torch.finfo(dtype).eps:
            gdtype = case.weights.dtype  # (it comes from the down GEMM's rows: the coarser of the two dtypes)
        close(got.grad, w64.grad, gdtype, f"d {name}", mag=m64.grad.abs() + w64.grad.abs())
    return COMPARED
