"""The op fuzz suite's strategies and runners for ``rms_norm`` and ``rope``.

Drawn: strided and offset layouts of every input (q and k in any memory order, Hugging Face's
transposed views among them; cos/sin as ``[S, D]``, ``[1, S, D]`` or ``[B, S, D]``, any strides),
zero-size batches, a NaN planted in x, weight or none, the Gemma offset, cos/sin of another dtype,
split-half and interleaved pairs. Now and then a call the contract refuses (a bad eps or offset,
an odd head_dim, cos/sin of the wrong shape): only an honest refusal passes those. The reference
runs on float64 host copies; forward and gradients are judged against the same formulas on
absolute values (the rounding-error bound of the row reductions), and inputs must stay unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import polyaccel.ops as ops
import torch
from hypothesis import strategies as st
from polyaccel.ops import reference as ref
from polyaccel.ops.reference.rope import heads_view, rotate

from .fuzz_layouts import Buffers, Layout, TensorSpec, draw_layout, draw_specials, dtype_name, host64
from .fuzz_outcome import COMPARED, REFUSED, attempt, close, fail, pretty_repr, unchanged

SEEDS = st.integers(0, 2**31 - 1)
_KINDS = st.sampled_from(("valid",) * 4 + ("bad",) * 2 + ("valid",) * 4)


# ============================================================================== rms_norm
@dataclass(frozen=True)
class RmsNormCase:
    x: TensorSpec
    weight: TensorSpec | None
    eps: float
    offset: float
    seed: int
    refuse: str = ""

    def __repr__(self) -> str:
        w = repr(self.weight) if self.weight is not None else "weight: None"
        tail = f" | must refuse: {self.refuse}" if self.refuse else ""
        return f"rms_norm(eps={self.eps!r}, offset={self.offset!r}) | {self.x!r} | {w} | seed {self.seed}{tail}"

    _repr_pretty_ = pretty_repr


@st.composite
def rms_norm_cases(draw, dtypes: tuple[torch.dtype, ...]) -> RmsNormCase:
    dtype = draw(st.sampled_from(dtypes))
    lead = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=2)))
    h = draw(st.sampled_from((1, 2, 5, 8, 33, 70)))
    shape = lead + (h,)
    x = TensorSpec("x", draw_layout(draw, shape), dtype, draw_specials(draw, math.prod(shape), (math.nan,), 1))
    weight = None
    if draw(st.sampled_from((True, True, False))):
        weight = TensorSpec("weight", draw_layout(draw, (h,)), draw(st.sampled_from(dtypes)))
    eps = draw(st.sampled_from((1e-6, 1e-5, 0.1)))
    offset = draw(st.sampled_from((0.0, 1.0))) if weight is not None else 0.0
    refuse = ""
    if draw(_KINDS) == "bad":
        what = draw(st.sampled_from(("eps", "offset")))
        if what == "eps":
            eps = draw(st.sampled_from((math.nan, -1e-6, math.inf)))
            refuse = f"eps={eps!r}"
        else:
            offset = draw(st.sampled_from((math.nan, math.inf) if weight is not None else (1.0, math.nan)))
            refuse = f"offset={offset!r}" + (" with weight None" if weight is None else "")
    return RmsNormCase(x, weight, eps, offset, draw(SEEDS), refuse)


def run_rms_norm(case: RmsNormCase, device: torch.device) -> str:
    bufs = Buffers(device, torch.Generator().manual_seed(case.seed))
    x = bufs.make(case.x, scale=2.0).detach().requires_grad_(True)
    w = None if case.weight is None else bufs.make(case.weight).detach().requires_grad_(True)
    grad_out = bufs.make(TensorSpec("grad_out", Layout.contiguous(case.x.layout.shape), case.x.dtype))

    def call():
        out = ops.rms_norm(x, w, case.eps, offset=case.offset)
        out.backward(grad_out)
        return out

    outcome, out = attempt(call, bufs, case.refuse)
    if outcome == REFUSED:
        return f"{REFUSED}: {bufs.refusal}"
    unchanged(bufs, {e[0] for e in bufs.entries})
    x64 = host64(x).requires_grad_(True)
    w64 = None if w is None else host64(w).requires_grad_(True)
    go64 = host64(grad_out)
    want = ref.rms_norm(x64, w64, case.eps, offset=case.offset)
    want.backward(go64)
    # bounds: the closed forms on absolute values
    xd = x64.detach()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + case.eps)
    xhat = (xd * rstd).abs()
    scale = 1.0 if w64 is None else (case.offset + w64.detach()).abs()
    g = go64.abs() * scale
    dtype = case.x.dtype
    if out.dtype != dtype:
        fail(f"result is {out.dtype}, expected {dtype}")
    close(out, want, dtype, "forward", mag=xhat * scale)
    if x.grad is None or (w is not None and w.grad is None):
        fail("backward produced no gradient for x or weight")
    close(x.grad, x64.grad, dtype, "dx", mag=rstd * (g + xhat * (g * xhat).mean(-1, keepdim=True)))
    if w is not None:
        if w.grad.dtype != w.dtype:
            fail(f"d weight is {w.grad.dtype}, expected the weight's {w.dtype}")
        coarse = w.dtype if torch.finfo(w.dtype).eps > torch.finfo(dtype).eps else dtype
        close(w.grad, w64.grad, coarse, "d weight", mag=(go64.abs() * xhat).reshape(-1, xd.shape[-1]).sum(0))
    return COMPARED


# ================================================================================== rope
@dataclass(frozen=True)
class RopeCase:
    q: TensorSpec
    k: TensorSpec
    cos: TensorSpec
    sin: TensorSpec
    interleaved: bool
    seed: int
    refuse: str = ""

    def __repr__(self) -> str:
        mode = "interleaved" if self.interleaved else "split-half"
        tail = f" | must refuse: {self.refuse}" if self.refuse else ""
        return (f"rope({mode}) | {self.q!r} | {self.k!r} | {self.cos!r} | {self.sin!r} | cos/sin "
                f"{dtype_name(self.cos.dtype)} | seed {self.seed}{tail}")

    _repr_pretty_ = pretty_repr


@st.composite
def rope_cases(draw, dtypes: tuple[torch.dtype, ...]) -> RopeCase:
    dtype = draw(st.sampled_from(dtypes))
    b, s = draw(st.integers(0, 3)), draw(st.integers(0, 4))
    hq, hk = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    d = draw(st.sampled_from((2, 4, 6, 8, 16)))
    form = draw(st.sampled_from(("SD", "1SD", "BSD")))
    refuse = ""
    if draw(_KINDS) == "bad":
        if draw(st.booleans()):
            d += 1
            refuse = f"an odd head_dim {d}"
        else:
            form = "wrong"
            refuse = "cos/sin of a shape that does not match q"
    cs_shape = {"SD": (s, d), "1SD": (1, s, d), "BSD": (b, s, d), "wrong": (s + 1, d)}[form]
    cs_dtype = draw(st.sampled_from(dtypes))
    cos_l, sin_l = draw_layout(draw, cs_shape), draw_layout(draw, cs_shape)
    return RopeCase(TensorSpec("q", draw_layout(draw, (b, hq, s, d)), dtype),
                    TensorSpec("k", draw_layout(draw, (b, hk, s, d)), dtype),
                    TensorSpec("cos", cos_l, cs_dtype), TensorSpec("sin", sin_l, cs_dtype), draw(st.booleans()),
                    draw(SEEDS), refuse)


def run_rope(case: RopeCase, device: torch.device) -> str:
    bufs = Buffers(device, torch.Generator().manual_seed(case.seed))
    q = bufs.make(case.q).detach().requires_grad_(True)
    k = bufs.make(case.k).detach().requires_grad_(True)
    angle = torch.rand(case.cos.layout.shape, generator=bufs.generator, dtype=torch.float64) * 6.3
    cos = bufs.make(case.cos, values=angle.cos())
    sin = bufs.make(case.sin, values=angle.sin())
    gq = bufs.make(TensorSpec("grad q_out", Layout.contiguous(case.q.layout.shape), case.q.dtype))
    gk = bufs.make(TensorSpec("grad k_out", Layout.contiguous(case.k.layout.shape), case.k.dtype))

    def call():
        qo, ko = ops.rope(q, k, cos, sin, interleaved=case.interleaved)
        torch.autograd.backward([qo, ko], [gq, gk])
        return qo, ko

    outcome, outs = attempt(call, bufs, case.refuse)
    if outcome == REFUSED:
        return f"{REFUSED}: {bufs.refusal}"
    unchanged(bufs, {e[0] for e in bufs.entries})
    q64, k64 = host64(q).requires_grad_(True), host64(k).requires_grad_(True)
    c64, s64 = host64(cos), host64(sin)
    wq, wk = ref.rope(q64, k64, c64, s64, interleaved=case.interleaved)
    torch.autograd.backward([wq, wk], [host64(gq), host64(gk)])
    ca, sa = heads_view(c64).abs(), heads_view(s64).abs()
    dtype = case.q.dtype
    for name, got, want, leaf, leaf64, g in (("q", outs[0], wq, q, q64, gq), ("k", outs[1], wk, k, k64, gk)):
        if got.dtype != dtype:
            fail(f"{name}_out is {got.dtype}, expected {dtype}")
        xa, ga = leaf64.detach().abs(), host64(g).abs()
        close(got, want, dtype, f"{name}_out", mag=xa * ca + rotate(xa, case.interleaved).abs() * sa)
        if leaf.grad is None:
            fail(f"backward produced no gradient for {name}")
        close(leaf.grad, leaf64.grad, dtype, f"d {name}", mag=ga * ca + rotate(ga * sa, case.interleaved).abs())
    return COMPARED
