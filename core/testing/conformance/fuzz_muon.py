"""The op fuzz suite's strategies and runners for ``newton_schulz`` and ``fused_muon``.

Drawn: strided and offset layouts, batches (for ``newton_schulz``), tall and wide matrices down to
one row or column and zero-size ones, head splits that fit, iteration dtypes, Nesterov or not,
hyperparameters, ``newton_schulz`` results into a fresh ``out`` of a drawn layout or over ``x``
itself; now and then a call the contract says must be refused (a bad hyperparameter or
Newton-Schulz setting, a param with overlapping storage, aliased written tensors, a head split
that does not divide its dim, an ``out`` of another dtype or with overlapping storage), for which
only an honest refusal passes. The reference runs on float64 copies, iterating in float64; results
are judged per matrix by the relative Frobenius bounds of :mod:`.opcases_muon`, gradients and
inputs (``x`` but where it is ``out``) must come back bitwise unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass

import polyaccel.ops as ops
import torch
from hypothesis import strategies as st
from polyaccel.ops import reference as ref

from .fuzz_layouts import Buffers, TensorSpec, draw_layout, host64
from .fuzz_outcome import COMPARED, REFUSED, attempt, close, fail, pretty_repr, unchanged
from .opcases_muon import CLASSIC, NS_BOUNDS, param_excess, relative_errors

SEEDS = st.integers(0, 2**31 - 1)
_DIMS = st.integers(0, 7)
_KINDS = st.sampled_from(("valid",) * 6 + ("bad setting", "overlapping param", "aliased tensors", "bad split")
                         + ("valid",) * 6)
NS_VALID = {"steps": (5, 0, 1, 3), "coefficients": (ref.muon.NS_COEFFICIENTS, CLASSIC), "eps": (1e-7, 1e-3)}
NS_BAD = {"steps": (-1, 100, 2.0, True), "coefficients": ((1.0, 2.0), (math.nan, 1.0, 1.0), (1.0, math.inf, 0.0)),
          "eps": (0.0, -1e-7, math.nan)}
MUON_VALID = {"lr": (0.02, 0.0, 0.3), "momentum": (0.95, 0.0, 0.5), "weight_decay": (0.0, 0.1),
              "nesterov": (True, False), "lr_adjustment": ("original", "match_rms_adamw", "none")}
MUON_BAD = {"lr": (-1e-3, math.nan, math.inf), "momentum": (1.0, -0.1, math.nan),
            "weight_decay": (-0.1, math.inf), "ns_steps": (-1, 100), "eps": (0.0, math.nan),
            "lr_adjustment": ("rms",)}


def _check_matrices(got: torch.Tensor, want: torch.Tensor, bound: float, what: str) -> None:
    """Per matrix: the relative Frobenius error within ``bound``; NaN exactly where the reference's matrix has NaN."""
    if tuple(got.shape) != tuple(want.shape):
        fail(f"{what}: shape {tuple(got.shape)}, the reference's is {tuple(want.shape)}")
    if not got.numel():
        return
    g = got.detach().to("cpu", torch.float64).reshape(-1, *got.shape[-2:])
    w = want.reshape(-1, *want.shape[-2:])
    finite = w.isfinite().flatten(1).all(1)
    for k in (~finite & g.isfinite().flatten(1).all(1)).nonzero().flatten().tolist():
        fail(f"{what}: matrix {k} is finite where the reference's is not")
    rel = relative_errors(g[finite], w[finite])
    for k, r in zip(finite.nonzero().flatten().tolist(), rel.tolist(), strict=True):
        if not r <= bound:  # NaN fails
            fail(f"{what}: matrix {k} is {r:.3e} off the reference (relative Frobenius), allowed {bound:g}")


# ============================================================================ newton_schulz
#: where a drawn call puts its result: a new tensor (no ``out``), a fresh ``out`` of a drawn layout, ``x`` itself
NS_OUTS = ("none",) * 4 + ("new", "x")
_OTHER_DTYPE = {torch.float64: torch.float32, torch.float32: torch.float64, torch.bfloat16: torch.float16,
                torch.float16: torch.bfloat16}


@dataclass(frozen=True)
class NewtonSchulzCase:
    x: TensorSpec
    steps: object
    coefficients: object
    eps: object
    seed: int
    refuse: str = ""
    out: str = "none"  # one of NS_OUTS
    out_spec: TensorSpec | None = None  # the fresh out's layout and dtype ("new")

    def __repr__(self) -> str:
        must = f" | must refuse: {self.refuse}" if self.refuse else ""
        into = {"none": "", "x": ", out=x", "new": ", out=out"}[self.out]
        spec = f" | {self.out_spec!r}" if self.out_spec is not None else ""
        return (f"newton_schulz(x, steps={self.steps!r}, coefficients={self.coefficients!r}, eps={self.eps!r}"
                f"{into}) | {self.x!r}{spec} | seed {self.seed}{must}")

    _repr_pretty_ = pretty_repr


@st.composite
def newton_schulz_cases(draw, dtypes: tuple[torch.dtype, ...]) -> NewtonSchulzCase:
    dtype = draw(st.sampled_from(dtypes))
    batch = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    shape = batch + (draw(_DIMS), draw(_DIMS))
    kind = draw(st.sampled_from(("valid",) * 7 + ("bad setting", "bad out") + ("valid",) * 7))
    hyper = {k: draw(st.sampled_from(v)) for k, v in NS_VALID.items()}
    refuse = ""
    if kind == "bad setting":
        key = draw(st.sampled_from(sorted(NS_BAD)))
        hyper[key] = draw(st.sampled_from(NS_BAD[key]))
        refuse = f"{key}={hyper[key]!r}"
    out, out_spec = draw(st.sampled_from(NS_OUTS)), None
    if kind == "bad out":  # an out of another dtype, or expanded (two elements at one memory location)
        out = "new"
        if draw(st.booleans()) or not any(n > 1 for n in shape):
            out_spec = TensorSpec("out", draw_layout(draw, shape), _OTHER_DTYPE[dtype])
            refuse = f"out of dtype {out_spec.dtype} for x of {dtype}"
        else:
            out_spec = TensorSpec("out", draw_layout(draw, shape, overlap=True), dtype)
            refuse = "an out with elements sharing one memory location"
    elif out == "new":
        out_spec = TensorSpec("out", draw_layout(draw, shape), dtype)
    return NewtonSchulzCase(TensorSpec("x", draw_layout(draw, shape), dtype), hyper["steps"],
                            hyper["coefficients"], hyper["eps"], draw(SEEDS), refuse, out, out_spec)


def run_newton_schulz(case: NewtonSchulzCase, device: torch.device) -> str:
    bufs = Buffers(device, torch.Generator().manual_seed(case.seed))
    x = bufs.make(case.x)
    into = {"none": None, "x": x, "new": bufs.make(case.out_spec) if case.out_spec is not None else None}[case.out]
    x64 = host64(x)
    outcome, out = attempt(lambda: ops.newton_schulz(x, steps=case.steps, coefficients=case.coefficients,
                                                     eps=case.eps, out=into), bufs, case.refuse)
    if outcome == REFUSED:
        return f"{REFUSED}: {bufs.refusal}"
    if case.out != "x":
        unchanged(bufs, {"x"})
    if into is not None and out is not into:
        fail("the result is not the out passed")
    if out.dtype != case.x.dtype:
        fail(f"result is {out.dtype}, expected {case.x.dtype}")
    want = ref.newton_schulz(x64, steps=case.steps, coefficients=case.coefficients, eps=case.eps)
    _check_matrices(out, want, NS_BOUNDS[case.x.dtype], "result")
    return COMPARED


# ============================================================================ fused_muon
@dataclass(frozen=True)
class FusedMuonCase:
    groups: tuple[tuple[TensorSpec, TensorSpec, TensorSpec], ...]  # per tensor: param, grad, momentum_buffer
    splits: tuple | None
    hyper: tuple[tuple[str, object], ...]
    ns_dtype: torch.dtype
    seed: int
    alias: str = ""
    refuse: str = ""

    def __repr__(self) -> str:
        hyper = " ".join(f"{k}={v!r}" for k, v in self.hyper)
        parts = [f"fused_muon: {hyper} ns_dtype={self.ns_dtype} head_splits={self.splits!r}; seed {self.seed}"]
        parts += [f"tensor {i}: " + "; ".join(map(repr, g)) for i, g in enumerate(self.groups)]
        if self.alias:
            parts.append(f"aliased: {self.alias}")
        if self.refuse:
            parts.append(f"must refuse: {self.refuse}")
        return " | ".join(parts)

    _repr_pretty_ = pretty_repr


def _fitting_split(draw, shape):
    dim = draw(st.sampled_from((0, 1)))
    size = shape[dim]
    divisors = [h for h in range(1, size + 1) if size % h == 0] or [1]
    return (dim, draw(st.sampled_from(divisors)))


def _muon_groups(draw, kind: str, n: int, dtype, state_dtype) -> tuple[list, list]:
    """The case's ``n`` groups (param, grad, momentum_buffer) and their shapes, with ``kind``'s overlap or alias."""
    groups, shapes = [], []
    for i in range(n):
        if kind == "aliased tensors" and i == 1:
            groups.append(tuple(TensorSpec(s.role[:-1] + "1", s.layout, s.dtype) for s in groups[0]))
            shapes.append(shapes[0])
            continue
        shape = (draw(st.integers(1 if kind != "valid" else 0, 7)), draw(st.integers(2 if kind != "valid" else 0, 7)))
        shapes.append(shape)
        specs = []
        for role in ("param", "grad", "momentum_buffer"):
            overlap = kind == "overlapping param" and i == 0 and role == "param"
            specs.append(TensorSpec(f"{role} {i}", draw_layout(draw, shape, overlap=overlap),
                                    dtype if role != "momentum_buffer" else state_dtype))
        groups.append(tuple(specs))
    return groups, shapes


def _muon_refusal(draw, kind: str, hyper: dict, shapes: list, splits):
    """``(refuse, alias, splits)`` for a case of ``kind`` (a bad setting planted into ``hyper``, a bad head
    split into ``splits``)."""
    if kind == "bad setting":
        key = draw(st.sampled_from(sorted(MUON_BAD)))
        hyper[key] = draw(st.sampled_from(MUON_BAD[key]))
        return f"{key}={hyper[key]!r}", "", splits
    if kind == "overlapping param":
        return "a param with overlapping storage (a stride-0 expand)", "", splits
    if kind == "aliased tensors":
        alias = draw(st.sampled_from(("momentum_buffer 0 is param 0", "tensor 1 is tensor 0")))
        return f"aliased written tensors ({alias})", alias, splits
    if kind == "bad split":
        rows = shapes[0][0] + 1  # more heads than rows
        return f"head split (0, {rows}) of a {shapes[0]} tensor", "", ((0, rows),) + (None,) * (len(shapes) - 1)
    return "", "", splits


@st.composite
def fused_muon_cases(draw, dtypes: tuple[torch.dtype, ...]) -> FusedMuonCase:
    dtype = draw(st.sampled_from(dtypes))
    state_dtype = dtype if dtype in (torch.float32, torch.float64) else draw(st.sampled_from((torch.float32, dtype)))
    kind = draw(_KINDS)
    n = draw(st.integers(2 if kind == "aliased tensors" else 1, 3))
    groups, shapes = _muon_groups(draw, kind, n, dtype, state_dtype)
    splits = None
    if draw(st.booleans()):
        splits = tuple(_fitting_split(draw, s) if draw(st.booleans()) and min(s) > 0 else None for s in shapes)
    hyper = {k: draw(st.sampled_from(v)) for k, v in MUON_VALID.items()}
    hyper["ns_steps"] = draw(st.sampled_from((5, 2, 0)))
    hyper["ns_coefficients"] = draw(st.sampled_from((ref.muon.NS_COEFFICIENTS, CLASSIC)))
    hyper["eps"] = 1e-7
    ns_dtype = draw(st.sampled_from((torch.bfloat16, dtype)))
    refuse, alias, splits = _muon_refusal(draw, kind, hyper, shapes, splits)
    return FusedMuonCase(tuple(groups), splits, tuple(hyper.items()), ns_dtype, draw(SEEDS), alias, refuse)


def run_fused_muon(case: FusedMuonCase, device: torch.device) -> str:
    bufs = Buffers(device, torch.Generator().manual_seed(case.seed))
    lists: list[list[torch.Tensor]] = [[], [], []]
    for group in case.groups:
        for k, spec in enumerate(group):
            lists[k].append(bufs.make(spec, scale=0.1 if k == 2 else 1.0))
    if case.alias == "momentum_buffer 0 is param 0":
        lists[2][0] = lists[0][0]
    elif case.alias == "tensor 1 is tensor 0":
        for lst in lists:
            lst[1] = lst[0]
    kw = dict(case.hyper)
    splits = None if case.splits is None else list(case.splits)
    copies = [[host64(t) for t in lst] for lst in lists]
    start = [c.clone() for c in copies[0]]
    outcome, _ = attempt(lambda: ops.fused_muon(*lists, ns_dtype=case.ns_dtype, head_splits=splits, **kw), bufs,
                         case.refuse)
    if outcome == REFUSED:
        return f"{REFUSED}: {bufs.refusal}"
    unchanged(bufs, {s.role for g in case.groups for s in g if s.role.startswith("grad")})
    ref.fused_muon(*copies, ns_dtype=torch.float64, head_splits=splits, **kw)
    for i, (got, want) in enumerate(zip(lists[0], copies[0], strict=True)):
        dtype = case.groups[i][0].dtype
        if got.dtype != dtype:
            fail(f"param {i} changed dtype from {dtype} to {got.dtype}")
        if excess := param_excess(got, want, start[i], dtype, NS_BOUNDS[case.ns_dtype]):
            fail(f"param {i}: {excess}")
    for i, (got, want) in enumerate(zip(lists[2], copies[2], strict=True)):
        spec = case.groups[i][2]
        if got.dtype != spec.dtype:
            fail(f"momentum_buffer {i} changed dtype from {spec.dtype} to {got.dtype}")
        close(got, want, spec.dtype, f"momentum_buffer {i}")
    return COMPARED


__all__ = ["FusedMuonCase", "NewtonSchulzCase", "fused_muon_cases", "newton_schulz_cases", "run_fused_muon",
           "run_newton_schulz"]
