"""Conformance cases of the Muon ops: ``newton_schulz`` and ``fused_muon`` against the float64 reference.

The builder runs on the device on fresh random inputs; the reference runs on float64 host copies
and iterates in float64, so it is the exact iteration. The comparison is per matrix, by the
relative Frobenius error of the result (of the update, for ``fused_muon``), with a bound per
iteration dtype:

* float64: 1e-9. The iteration is the same arithmetic in the same dtype.
* float32: 1e-4. Measured errors of an fp32 iteration are ~1e-6; the quintic's slope at small
  singular values (a = 3.4445) amplifies a rounding error up to a^5 ~ 500 times over 5 steps,
  so the bound leaves ~1000 fp32 ulps.
* float16: 2e-2; bfloat16: 1e-1. Every product is rounded to the 16-bit dtype; the reference's
  own bf16 iteration is 1-5% off the float64 one (measured on these shapes; fp16 0.2-0.6%), and
  a GPU's or Triton interpreter's rounding (truncation) may double that.

What the bounds catch: a builder that ignores the coefficients (some cases use the classic
quintic ``(15/8, -10/8, 3/8)``, whose result is 20-40% away from the default's), that transposes
a tall matrix in but not back out, that orthogonalizes a whole matrix where a head split asks for blocks, that gets the
momentum, Nesterov, weight decay or the learning-rate scale wrong. Note that skipping the
transpose of a tall matrix altogether is *not* a defect: ``p(X X^T) X = X p(X^T X)``, only
slower.
"""

from __future__ import annotations

import math

import torch
from polyaccel.ops import reference as ref

from .opcases import _close, _dev

#: relative Frobenius bound of one matrix's result per iteration dtype (see the module docstring)
NS_BOUNDS = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}
#: the classic quintic (15/8, -10/8, 3/8): converges to 1; after 5 steps 20-40% away from the default's result
CLASSIC = (1.875, -1.25, 0.375)

#: (shape, steps, coefficients): wide, tall, batched both ways, square, a vector-like row, empty, aligned.
#: A GPU compiles a kernel once per pattern of its sizes and strides (multiple of 16, equal to 1, neither):
#: every ragged case here has no size or stride that is a multiple of 16, so they share one compile per
#: kernel, and two cases give the other patterns: the row (one row) and the aligned batch (every size a
#: multiple of 16, the layout of real weights). ``benchmarks/conformance_compiles.py`` counts the compiles.
NS_CASES = [
    ((5, 9), 5, None), ((13, 6), 5, None), ((3, 7, 11), 5, None), ((2, 13, 5), 5, None), ((4, 7, 7), 5, None),
    ((2, 2, 33, 19), 5, None), ((1, 17), 5, None), ((0, 4), 5, None), ((3, 0, 5), 5, None),
    ((2, 16, 32), 5, None), ((2, 23, 23), 5, CLASSIC), ((41, 15), 8, CLASSIC), ((6, 10), 0, None),
    ((6, 10), 2, None),
]


def relative_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per matrix: ||got - want||_F / ||want||_F (float64; 0 where both are zero)."""
    diff = torch.linalg.vector_norm(got.double() - want, dim=(-2, -1))
    norm = torch.linalg.vector_norm(want, dim=(-2, -1))
    return torch.where(norm > 0, diff / norm.clamp_min(1e-300), diff)


def _check_matrices(got, want, bound: float, where: str) -> None:
    if got.numel() == 0:
        return
    rel = relative_errors(got.detach().cpu(), want)
    worst = float(rel.max())
    assert math.isfinite(worst) and worst <= bound, (
        f"{where}: relative Frobenius error {worst:.3e} of a matrix exceeds {bound:g}")


def check_newton_schulz(fn, device: torch.device, dtype: torch.dtype) -> None:
    bound = NS_BOUNDS[dtype]
    for shape, steps, coefficients in NS_CASES:
        coefficients = coefficients or ref.muon.NS_COEFFICIENTS
        x = torch.randn(shape).to(dtype)
        where = f"newton_schulz {dtype} shape {shape} steps {steps} coefficients {coefficients}"
        x_dev = _dev(x, device)
        got = fn(x_dev, steps=steps, coefficients=coefficients, eps=1e-7)
        assert got.shape == x.shape and got.dtype == dtype, f"{where}: got {got.dtype}{tuple(got.shape)}"
        assert torch.equal(x_dev.cpu(), x), f"{where}: the input was modified"
        want = ref.newton_schulz(x.double(), steps=steps, coefficients=coefficients, eps=1e-7)
        _check_matrices(got, want, bound, where)
    # a batch with a zero matrix and one holding NaN: zero stays zero, NaN stays in its matrix
    x = torch.randn(3, 6, 10).to(dtype)
    x[1] = 0
    x[2, 3, 4] = float("nan")
    got = fn(_dev(x, device), steps=5, coefficients=ref.muon.NS_COEFFICIENTS, eps=1e-7).cpu()
    where = f"newton_schulz {dtype} batch with a zero and a NaN matrix"
    assert bool((got[1] == 0).all()), f"{where}: the zero matrix did not stay zero"
    assert bool(got[2].isnan().all()), f"{where}: the matrix holding NaN is not NaN throughout"
    _check_matrices(got[:1], ref.newton_schulz(x[:1].double()), bound, where)
    _check_newton_schulz_out(fn, device, dtype)


#: (shape, steps) of the ``out`` cases: wide, tall, a 4-D batch of tall matrices; an odd and an even step count
NS_OUT_CASES = [((3, 7, 11), 5), ((2, 13, 5), 4), ((2, 2, 9, 6), 3), ((2, 16, 32), 2)]


def _out_layouts(x: torch.Tensor) -> dict:
    """Fresh ``out`` tensors for ``x``: row-major, and column-major (the matrices transposed in memory)."""
    col = torch.empty(*x.shape[:-2], x.shape[-1], x.shape[-2], dtype=x.dtype, device=x.device).mT
    return {"a new row-major out": torch.empty_like(x, memory_format=torch.contiguous_format),
            "a new column-major out": col}


def _check_newton_schulz_out(fn, device: torch.device, dtype: torch.dtype) -> None:
    """``out``: the result written into a new tensor of either layout, or over ``x`` itself (out=x); the call
    returns ``out``, the values are the call's without ``out`` and within the bound of the float64 reference."""
    bound = NS_BOUNDS[dtype]
    for shape, steps in NS_OUT_CASES:
        kw = {"steps": steps, "coefficients": ref.muon.NS_COEFFICIENTS, "eps": 1e-7}
        x = torch.randn(shape).to(dtype)
        want = ref.newton_schulz(x.double(), **kw)
        x_dev = _dev(x, device)
        plain = fn(x_dev, **kw).cpu()
        outs = _out_layouts(x_dev)
        for name, out in outs.items():
            where = f"newton_schulz {dtype} shape {shape} steps {steps} into {name}"
            got = fn(x_dev, **kw, out=out)
            assert got is out, f"{where}: the call returned another tensor than out"
            assert torch.equal(x_dev.cpu(), x), f"{where}: the input was modified"
            assert torch.equal(out.cpu(), plain), f"{where}: the values differ from the call without out"
            _check_matrices(out, want, bound, where)
        for name, y in outs.items():  # out=x: the result replaces x, whatever x's layout
            where = f"newton_schulz {dtype} shape {shape} steps {steps} out=x, x in {name.removeprefix('a new ')}"
            y.copy_(x_dev)
            alone = fn(y.clone(), **kw).cpu()  # the same x, layout included (a layout may round the products apart)
            got = fn(y, **kw, out=y)
            assert got is y, f"{where}: the call returned another tensor than out"
            assert torch.equal(y.cpu(), alone), f"{where}: the values differ from the call without out"
            _check_matrices(y, want, bound, where)


# ------------------------------------------------------------------------------ fused_muon
#: shapes of one call: tall, wide, square, empty, and head-split ones; splits are used by some cases. Sizes,
#: head blocks included, are ragged (no multiple of 16: one compile per kernel, see NS_CASES; the aligned and
#: one-row patterns are the Newton-Schulz check's)
MUON_SHAPES = [(13, 7), (7, 13), (15, 15), (0, 5), (21, 10), (6, 9)]
MUON_SPLITS = [None, None, (0, 5), None, (0, 3), (1, 3)]
MUON_ARGS = [
    dict(lr=0.3, momentum=0.95, weight_decay=0.1, nesterov=True, lr_adjustment="original", split=True),
    dict(lr=0.2, momentum=0.9, weight_decay=0.0, nesterov=False, lr_adjustment="match_rms_adamw",
         ns_steps=8, ns_coefficients=CLASSIC, split=False),
    dict(lr=0.5, momentum=0.5, weight_decay=0.05, nesterov=True, lr_adjustment="none", split=True),
]


def _ns_dtypes(dtype: torch.dtype) -> list[torch.dtype]:
    """The iteration dtypes a call with params of ``dtype`` is checked with."""
    return {torch.float64: [torch.float64, torch.bfloat16], torch.float32: [torch.float32, torch.bfloat16],
            torch.bfloat16: [torch.bfloat16], torch.float16: [torch.float16, torch.bfloat16]}[dtype]


def _muon_inputs(dtype, state_dtype):
    params = [torch.randn(s).to(dtype) for s in MUON_SHAPES]
    bufs = [torch.randn(s).mul(0.1).to(state_dtype) for s in MUON_SHAPES]
    return params, bufs


def param_excess(got, want, start, dtype, bound) -> str:
    """Why the update ``got - start`` is outside ``bound`` of the reference's (relative Frobenius), plus the
    rounding of ``dtype`` on the parameter itself; "" when it is inside."""
    if want.numel() == 0:
        return ""
    got64, want64, start64 = got.detach().cpu().double(), want, start.double()
    rtol, atol = (0.0, 0.0) if dtype == torch.float64 else {
        torch.float32: (2e-6, 1e-7), torch.bfloat16: (2 ** -8, 1e-5), torch.float16: (2 ** -11, 1e-5)}[dtype]
    err = float(torch.linalg.vector_norm(got64 - want64))
    rounding = float(torch.linalg.vector_norm(atol + rtol * want64.abs()))
    step = float(torch.linalg.vector_norm(want64 - start64))
    allowed = bound * step + rounding + 1e-12
    if err <= allowed:
        return ""
    return (f"the parameter is {err:.3e} off the reference (Frobenius); allowed {allowed:.3e} "
            f"({bound:g} of the update's {step:.3e} plus {dtype} rounding)")


def _check_param(got, want, start, dtype, bound, where) -> None:
    excess = param_excess(got, want, start, dtype, bound)
    assert not excess, f"{where}: {excess}"


def check_fused_muon(fn, device: torch.device, dtype: torch.dtype) -> None:
    state_dtypes = [dtype] if dtype in (torch.float32, torch.float64) else [torch.float32, dtype]
    for state_dtype in state_dtypes:
        for ns_dtype in _ns_dtypes(dtype):
            for args in MUON_ARGS:
                _check_fused_muon_case(fn, device, dtype, state_dtype, ns_dtype, args)


def _check_fused_muon_case(fn, device, dtype, state_dtype, ns_dtype, args) -> None:
    """Two steps of ``fn`` on the device against the float64 reference, for one combination of settings."""
    kw = {k: v for k, v in args.items() if k != "split"}
    splits = MUON_SPLITS if args["split"] else None
    params, bufs = _muon_inputs(dtype, state_dtype)
    start = [p.clone() for p in params]
    mine_p = [_dev(p, device) for p in params]
    mine_b = [_dev(b, device) for b in bufs]
    ref_p = [p.double() for p in params]
    ref_b = [b.double() for b in bufs]
    for _ in range(2):
        grads = [torch.randn(s).to(dtype) for s in MUON_SHAPES]
        g_dev = [_dev(g, device) for g in grads]
        fn(mine_p, g_dev, mine_b, ns_dtype=ns_dtype, head_splits=splits, **kw)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(g_dev, grads, strict=True)), (
            f"fused_muon {dtype}: the gradients were modified")
        ref.fused_muon(ref_p, [g.double() for g in grads], ref_b, ns_dtype=torch.float64,
                       head_splits=splits, **kw)
    where = f"fused_muon params {dtype}, buffers {state_dtype}, ns_dtype {ns_dtype}, {kw}, head splits {splits}"
    for i, (got, want) in enumerate(zip(mine_p, ref_p, strict=True)):
        assert got.dtype == dtype, f"{where}: param {i} changed dtype to {got.dtype}"
        _check_param(got, want, start[i], dtype, NS_BOUNDS[ns_dtype], f"{where}: param {i} shape {MUON_SHAPES[i]}")
    for i, (got, want) in enumerate(zip(mine_b, ref_b, strict=True)):
        assert got.dtype == state_dtype, f"{where}: buffer {i} changed dtype to {got.dtype}"
        _close(got, want, state_dtype, f"{where}: momentum buffer {i} shape {MUON_SHAPES[i]}")
