"""Conformance cases of the model-layer ops ``rms_norm`` and ``rope``: fresh random inputs, forward and backward
on the device against the core reference on float64 host copies.

Reductions (RMSNorm's row mean, its weight gradient's sum over rows) are judged against the same
sums over absolute values (their rounding-error bound), not against the possibly cancelled result.
"""

from __future__ import annotations

import torch
from polyaccel.ops import reference as ref
from polyaccel.ops.reference.rope import heads_view, rotate

from .opcases import _dev, op_tolerances


def _within(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """|got - want| <= atol + rtol * mag elementwise (``mag`` bounds the rounding of the computation)."""
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not want.numel():
        return
    rtol, atol = op_tolerances(dtype)
    err = (got.detach().to("cpu", torch.float64) - want.detach()).abs()
    excess = err - (atol + rtol * mag.detach())
    worst = float(excess.max())
    assert worst <= 0 and not bool(err.isnan().any()), (
        f"{what}: error exceeds the bound by {worst:.3e} (max error {float(err.max()):.3e}, "
        f"{int((excess > 0).sum())} of {err.numel()} elements)")


# ------------------------------------------------------------------------------ rms_norm
#: (x shape, eps, offset, weight: "same" dtype / "fp32" / None). The two ragged rows of one block share
#: their width's block (one compile on a GPU, ``benchmarks/conformance_compiles.py``); 16 and 64 are aligned
RMS_NORM_CASES = [
    ((3, 37), 1e-6, 0.0, "same"), ((2, 3, 33), 1e-5, 1.0, "same"), ((0, 5), 1e-6, 0.0, "same"),
    ((4, 1100), 1e-6, 0.0, "fp32"), ((5, 16), 1e-6, 0.0, None), ((1, 1), 0.0, 1.0, "fp32"),
    ((6, 64), 1e-6, 0.5, "same"),
]


def _rms_norm_mags(x, w, go, eps, offset):
    """Bounds of the forward's, dx's and dw's rounding: the closed forms on absolute values (float64)."""
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    xhat = (x * rstd).abs()
    scale = torch.ones(x.shape[-1], dtype=x.dtype) if w is None else (offset + w).abs()
    g = go.abs() * scale
    fwd = xhat * scale
    dx = rstd * (g + xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (go.abs() * xhat).reshape(-1, x.shape[-1]).sum(0)
    return fwd, dx, dw


def check_rms_norm(fn, device: torch.device, dtype: torch.dtype) -> None:
    for shape, eps, offset, w_kind in RMS_NORM_CASES:
        H = shape[-1]
        w_dtype = None if w_kind is None else (dtype if w_kind == "same" else torch.float32)
        x = (torch.randn(shape) * 2).to(dtype)
        go = torch.randn(shape).to(dtype)
        w = None if w_dtype is None else (torch.randn(H) * 0.5 + (0.0 if offset else 1.0)).to(w_dtype)
        where = f"rms_norm {dtype} shape {shape} eps {eps} offset {offset} weight {w_dtype}"
        x_d = _dev(x, device).requires_grad_(True)
        w_d = None if w is None else _dev(w, device).requires_grad_(True)
        out = fn(x_d, w_d, eps, offset=offset)
        assert out.shape == x.shape and out.dtype == dtype, f"{where}: got {out.dtype}{tuple(out.shape)}"
        out.backward(_dev(go, device))
        x64 = x.double().requires_grad_(True)
        w64 = None if w is None else w.double().requires_grad_(True)
        want = ref.rms_norm(x64, w64, eps, offset=offset)
        want.backward(go.double())
        fwd_mag, dx_mag, dw_mag = _rms_norm_mags(x.double(), None if w is None else w.double(), go.double(), eps,
                                                 offset)
        _within(out, want.detach(), fwd_mag, dtype, f"{where}: forward")
        assert x_d.grad is not None, f"{where}: backward produced no gradient for x"
        _within(x_d.grad, x64.grad, dx_mag, dtype, f"{where}: dx")
        if w is not None:
            assert w_d.grad is not None and w_d.grad.dtype == w_dtype, (
                f"{where}: d weight is {None if w_d.grad is None else w_d.grad.dtype}, expected {w_dtype}")
            # the coarser of x's and the weight's precision bounds the weight gradient
            coarse = w_dtype if torch.finfo(w_dtype).eps > torch.finfo(dtype).eps else dtype
            _within(w_d.grad, w64.grad, dw_mag, coarse, f"{where}: d weight")


# ---------------------------------------------------------------------------------- rope
#: (B, Hq, Hk, S, D, cos/sin form, interleaved, q/k in Hugging Face's transposed layout, cos/sin in float32
#: rather than q's dtype). The float32 tables (a mixed-precision launch, its own compile on a GPU) are taken
#: by half the cases (split-half and interleaved, either layout, [1, S, D] and [B, S, D] tables among them),
#: not by every case (``benchmarks/conformance_compiles.py`` counts the compiles)
ROPE_CASES = [
    (2, 3, 1, 5, 8, "BSD", False, True, False), (1, 2, 2, 4, 6, "SD", True, False, False),
    (2, 4, 2, 3, 16, "1SD", False, False, True), (2, 2, 1, 3, 8, "BSD", True, True, True),
    (0, 2, 1, 3, 4, "SD", False, False, True), (1, 1, 1, 1, 2, "1SD", False, True, False),
]


def _qk(B, H, S, D, dtype, hf_layout):
    if hf_layout:  # a [B, S, H, D] projection viewed as [B, H, S, D] (what q_proj(x).view(...).transpose(1, 2) gives)
        return torch.randn(B, S, H, D).to(dtype).transpose(1, 2)
    return torch.randn(B, H, S, D).to(dtype)


def _cos_sin(B, S, D, form, dtype):
    shape = {"SD": (S, D), "1SD": (1, S, D), "BSD": (B, S, D)}[form]
    angle = torch.rand(shape) * 6.3
    return angle.cos().to(dtype), angle.sin().to(dtype)


def check_rope(fn, device: torch.device, dtype: torch.dtype) -> None:
    for B, Hq, Hk, S, D, form, interleaved, hf_layout, fp32_tables in ROPE_CASES:
        cs_dtype = torch.float32 if fp32_tables else dtype
        q, k = _qk(B, Hq, S, D, dtype, hf_layout), _qk(B, Hk, S, D, dtype, hf_layout)
        cos, sin = _cos_sin(B, S, D, form, cs_dtype)
        gq, gk = torch.randn(q.shape).to(dtype), torch.randn(k.shape).to(dtype)
        where = (f"rope {dtype} q {tuple(q.shape)} k {tuple(k.shape)} cos/sin {cs_dtype} {form} "
                 f"{'interleaved' if interleaved else 'split-half'}{' (HF layout)' * hf_layout}")
        q_d = _dev(q, device).requires_grad_(True)
        k_d = _dev(k, device).requires_grad_(True)
        qo, ko = fn(q_d, k_d, _dev(cos, device), _dev(sin, device), interleaved=interleaved)
        assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == dtype and ko.dtype == dtype, (
            f"{where}: got {qo.dtype}{tuple(qo.shape)} and {ko.dtype}{tuple(ko.shape)}")
        torch.autograd.backward([qo, ko], [_dev(gq, device), _dev(gk, device)])
        q64, k64 = q.double().requires_grad_(True), k.double().requires_grad_(True)
        wq, wk = ref.rope(q64, k64, cos.double(), sin.double(), interleaved=interleaved)
        torch.autograd.backward([wq, wk], [gq.double(), gk.double()])
        c, s = heads_view(cos.double()).abs(), heads_view(sin.double()).abs()
        for name, got, want, x, g, grad, want_grad in (("q", qo, wq, q, gq, q_d.grad, q64.grad),
                                                       ("k", ko, wk, k, gk, k_d.grad, k64.grad)):
            xa, ga = x.double().abs(), g.double().abs()
            fwd_mag = xa * c + rotate(xa, interleaved).abs() * s
            _within(got, want.detach(), fwd_mag, dtype, f"{where}: {name}_out")
            assert grad is not None, f"{where}: backward produced no gradient for {name}"
            _within(grad, want_grad, ga * c + rotate(ga * s, interleaved).abs(), dtype, f"{where}: d {name}")
