"""Triton RMSNorm and RoPE forward/backward under TRITON_INTERPRET=1 against float64 math written out here."""

from __future__ import annotations

import pytest
import torch
from polyaccel.plugins.cuda.kernels import rms_norm as kn
from polyaccel.plugins.cuda.kernels import rope as kr


def _check(got, want, mag, dtype, what):
    """|error| vs float64 within fp32 rounding of the computation's magnitude, or one 16-bit ulp (plus the
    fp32 part): the interpreter truncates on the final cast instead of rounding."""
    got = got.detach().double()
    if dtype == torch.float32:
        bound = mag * 2e-6 + 1e-7
    else:
        mant = 7 if dtype == torch.bfloat16 else 10
        ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - mant)
        bound = ulp * 1.01 + mag * 2e-6 + 1e-6
    err = (got - want).abs()
    assert not bool(err.isnan().any()), f"{what}: NaN"
    if not bool((err <= bound).all()):
        i = int((err - bound).argmax())
        raise AssertionError(f"{what}: max excess {float((err - bound).max()):.3e} at {i}: "
                             f"got {got.reshape(-1)[i].item()}, want {want.reshape(-1)[i].item()}")


# ------------------------------------------------------------------------------ rms_norm
def _rms64(x, w, go, eps, offset):
    """Float64 RMSNorm and its gradients, from sqrt of the sum of squares (not the reference's code)."""
    x, go = x.double(), go.double()
    H = x.shape[-1]
    r = 1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) / H + eps)
    scale = torch.ones(H, dtype=torch.float64) if w is None else offset + w.double()
    y = x * r * scale
    g = go * scale
    dx = r * g - x * r**3 * (g * x).sum(-1, keepdim=True) / H
    dw = (go * x * r).reshape(-1, H).sum(0)
    mag_dx = r * g.abs() + (x * r**3).abs() * (g * x).abs().sum(-1, keepdim=True) / H
    mag_dw = (go * x * r).abs().reshape(-1, H).sum(0)
    return y, dx, dw, (x * r * scale).abs(), mag_dx, mag_dw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,offset,max_block,programs,rows", [
    ((2, 5, 96), 0.0, kn.MAX_BLOCK, None, None),  # one pass, default tiles (all 10 rows in one masked tile)
    ((7, 33), 1.0, kn.MAX_BLOCK, 3, 2),           # Gemma's (1 + w); 2 programs of 2-row steps, a masked tail
    ((3, 100), 0.0, 32, 2, None),                 # rows wider than a block: the chunked two-pass kernels
])
def test_rms_norm_forward_and_backward_match_float64(dtype, shape, offset, max_block, programs, rows):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).requires_grad_()
    w = (torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(dtype).requires_grad_()
    go = torch.randn(shape, generator=gen).to(dtype)
    eps = 1e-5
    y, rstd = kn.rms_norm_forward(x.detach(), w.detach(), eps, offset, max_block=max_block, rows_per_step=rows)
    dx, dw = kn.rms_norm_backward(go, x.detach(), w.detach(), rstd, offset, max_block=max_block, programs=programs,
                                  rows_per_step=rows)
    want_y, want_dx, want_dw, mag_y, mag_dx, mag_dw = _rms64(x.detach(), w.detach(), go, eps, offset)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype and rstd.dtype == torch.float32
    _check(y, want_y, mag_y, dtype, "y")
    _check(dx, want_dx, mag_dx, dtype, "dx")
    _check(dw, want_dw, mag_dw, dtype, "dw")
    # the autograd op gives the same gradients
    out = kn.rms_norm(x, w, eps, offset=offset)
    out.backward(go)
    _check(x.grad, want_dx, mag_dx, dtype, "autograd dx")
    _check(w.grad, want_dw, mag_dw, dtype, "autograd dw")


def test_rms_norm_strided_input_no_weight_fp32_weight_and_partial_gradients():
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(40, 9, generator=gen)
    x = base.t()[:, ::2]  # [9, 20], neither rows nor columns contiguous: copied to rows
    go = torch.randn(9, 20, generator=gen)
    y = kn.rms_norm(x, None, 1e-6)
    want = _rms64(x, None, go, 1e-6, 0.0)
    _check(y, want[0], want[3], torch.float32, "y without weight")
    # bf16 activations with an fp32 weight: dw in the weight's dtype
    xb = torch.randn(4, 3, 16, generator=gen).bfloat16()
    w = torch.randn(16, generator=gen).requires_grad_()
    gob = torch.randn(4, 3, 16, generator=gen).bfloat16()
    kn.rms_norm(xb, w, 1e-6).backward(gob)
    assert w.grad.dtype == torch.float32
    want = _rms64(xb, w.detach(), gob, 1e-6, 0.0)
    _check(w.grad, want[2], want[5], torch.float32, "fp32 dw of bf16 x")
    # only x needs a gradient: no weight-gradient work, dw None
    y, rstd = kn.rms_norm_forward(xb, w.detach(), 1e-6, 0.0)
    dx, dw = kn.rms_norm_backward(gob, xb, w.detach(), rstd, 0.0, True, False)
    assert dw is None
    _check(dx, want[1], want[4], torch.bfloat16, "dx alone")
    # zero rows: empty results and a zero weight gradient
    x0 = torch.randn(0, 16, requires_grad=True)
    w0 = torch.randn(16, requires_grad=True)
    kn.rms_norm(x0, w0, 1e-6).sum().backward()
    assert x0.grad.shape == (0, 16) and bool((w0.grad == 0).all())


# ---------------------------------------------------------------------------------- rope
def _rope64(x, cos, sin, dy, interleaved):
    """Float64 rotary embedding as a complex product per pair (forward), and its transpose (backward)."""
    x, dy = x.double(), dy.double()
    c = cos.double() if cos.dim() == 4 else (cos.double()[None, None] if cos.dim() == 2 else cos.double()[:, None])
    s = sin.double() if sin.dim() == 4 else (sin.double()[None, None] if sin.dim() == 2 else sin.double()[:, None])
    D = x.shape[-1]
    h = D // 2
    idx1 = torch.arange(0, D, 2) if interleaved else torch.arange(h)
    idx2 = idx1 + 1 if interleaved else idx1 + h
    out, dx = torch.empty_like(x), torch.empty_like(x)
    x1, x2, g1, g2 = x[..., idx1], x[..., idx2], dy[..., idx1], dy[..., idx2]
    c1, c2, s1, s2 = c[..., idx1], c[..., idx2], s[..., idx1], s[..., idx2]
    out[..., idx1], out[..., idx2] = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    dx[..., idx1], dx[..., idx2] = g1 * c1 + g2 * s2, g2 * c2 - g1 * s1
    mag = torch.empty_like(x)
    mag[..., idx1], mag[..., idx2] = (x1 * c1).abs() + (x2 * s1).abs(), (x2 * c2).abs() + (x1 * s2).abs()
    gmag = torch.empty_like(x)
    gmag[..., idx1], gmag[..., idx2] = (g1 * c1).abs() + (g2 * s2).abs(), (g2 * c2).abs() + (g1 * s1).abs()
    return out, dx, mag, gmag


def _table(shape, gen, dtype, duplicated):
    D = shape[-1]
    if duplicated:  # Hugging Face's table: the same angles in both halves
        ang = torch.rand(*shape[:-1], D // 2, generator=gen) * 6.3
        ang = torch.cat([ang, ang], -1)
    else:
        ang = torch.rand(shape, generator=gen) * 6.3
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("table,hf_layout,block_h", [("BSD", True, None), ("SD", False, 1), ("1SD", True, 2)])
def test_rope_forward_and_backward_match_float64(dtype, interleaved, table, hf_layout, block_h):
    gen = torch.Generator().manual_seed(3)
    B, Hq, Hk, S, D = 2, 5, 2, 3, 12
    if hf_layout:  # q_proj(x).view(B, S, H, D).transpose(1, 2): read in place
        q = torch.randn(B, S, Hq, D, generator=gen).to(dtype).transpose(1, 2)
        k = torch.randn(B, S, Hk, D, generator=gen).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, S, D, generator=gen).to(dtype)
        k = torch.randn(B, Hk, S, D, generator=gen).to(dtype)
    shape = {"BSD": (B, S, D), "SD": (S, D), "1SD": (1, S, D)}[table]
    cos, sin = _table(shape, gen, dtype, duplicated=table != "SD")
    q.requires_grad_(), k.requires_grad_()
    gq, gk = torch.randn(q.shape, generator=gen).to(dtype), torch.randn(k.shape, generator=gen).to(dtype)
    qo, ko = kr.rope_forward(q.detach(), k.detach(), cos, sin, interleaved, block_hq=block_h, block_hk=block_h)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()  # outputs in the inputs' memory order
    dq, dk = kr.rope_backward(gq, gk, cos, sin, interleaved, block_hq=block_h, block_hk=block_h)
    for name, got, dgot, x, g in (("q", qo, dq, q, gq), ("k", ko, dk, k, gk)):
        want, want_d, mag, gmag = _rope64(x.detach(), cos, sin, g, interleaved)
        _check(got, want, mag, dtype, f"{name}_out")
        _check(dgot, want_d, gmag, dtype, f"d {name}")
    qo2, ko2 = kr.rope(q, k, cos, sin, interleaved=interleaved)
    torch.autograd.backward([qo2, ko2], [gq, gk])
    assert torch.equal(q.grad, dq) and torch.equal(k.grad, dk) and torch.equal(qo2, qo)


def test_rope_backward_takes_expanded_and_transposed_gradients():
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(1, 3, 4, 8, generator=gen, requires_grad=True)
    cos, sin = _table((4, 8), gen, torch.float32, duplicated=True)
    qo, ko = kr.rope(q, k, cos, sin)
    (qo.sum() + ko.sum()).backward()  # expanded (stride-0) gradients of ones
    for x in (q, k):
        want = _rope64(x.detach(), cos, sin, torch.ones(x.shape), False)
        _check(x.grad, want[1], want[3], torch.float32, "d from an expanded gradient")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_the_conformance_cases_pass_in_fp16_and_fp64(dtype):
    """The suite's own cases (zero rows, H = 1, no weight, an fp32 weight, the (1 + w) form, every cos/sin form)
    in the dtypes the tests above leave out: fp64 math in the kernels for fp64 inputs."""
    from polyaccel.testing.conformance import opcases_model

    opcases_model.check_rms_norm(kn.rms_norm, torch.device("cpu"), dtype)
    opcases_model.check_rope(kr.rope, torch.device("cpu"), dtype)
