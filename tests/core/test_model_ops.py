"""rms_norm and rope: the references against float64 math written out here, the closed-form backwards
builders implement, the cpu builders, and the contract's refusals (before any builder runs)."""

from __future__ import annotations

import math

import polyaccel.ops as ops
import pytest
import torch
from polyaccel.errors import OpArgumentError
from polyaccel.ops import reference as ref
from polyaccel.ops.reference.rms_norm import rms_norm_backward, rms_norm_forward
from polyaccel.ops.reference.rope import rope_backward
from polyaccel.plugins.cpu import model_ops as cpu_ops

F64 = torch.float64


def _rms_by_hand(x, w, eps, offset):
    H = x.shape[-1]
    out = torch.empty_like(x)
    for i, row in enumerate(x.reshape(-1, H)):
        r = 1.0 / math.sqrt(sum(float(v) ** 2 for v in row) / H + eps)
        out.view(-1, H)[i] = row * r * (offset + w if w is not None else 1.0)
    return out


def _rope_by_complex(x, cos, sin, interleaved):
    """Each pair as a complex number times e^{i theta} (valid for tables with equal angles in a pair)."""
    D = x.shape[-1]
    if interleaved:
        z = torch.complex(x[..., 0::2], x[..., 1::2])
        theta = torch.atan2(sin[..., 0::2], cos[..., 0::2])
    else:
        z = torch.complex(x[..., : D // 2], x[..., D // 2:])
        theta = torch.atan2(sin[..., : D // 2], cos[..., : D // 2])
    r = z * torch.polar(torch.ones_like(theta), theta)
    if interleaved:
        return torch.stack((r.real, r.imag), -1).flatten(-2)
    return torch.cat((r.real, r.imag), -1)


def test_rms_norm_reference_matches_the_formula_by_hand_and_its_closed_form_backward():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 6, generator=gen, dtype=F64)
    w = torch.randn(6, generator=gen, dtype=F64)
    for offset in (0.0, 1.0):
        torch.testing.assert_close(ref.rms_norm(x, w, 1e-5, offset=offset), _rms_by_hand(x, w, 1e-5, offset))
    torch.testing.assert_close(ref.rms_norm(x, None, 0.0), _rms_by_hand(x, None, 0.0, 0.0))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: ref.rms_norm(a, b, 1e-5, offset=0.5), (xr, wr))
    # the closed forms builders implement equal autograd's gradients of the reference
    go = torch.randn(x.shape, generator=gen, dtype=F64)
    ref.rms_norm(xr, wr, 1e-5, offset=0.5).backward(go)
    y, rstd = rms_norm_forward(x, w, 1e-5, 0.5)
    dx, dw = rms_norm_backward(go, x, w, rstd, 0.5)
    torch.testing.assert_close(dx, xr.grad)
    torch.testing.assert_close(dw, wr.grad)
    # 16-bit input: fp32 math, one rounding
    xb = x.bfloat16()
    torch.testing.assert_close(ref.rms_norm(xb, w.float(), 1e-5), _rms_by_hand(xb.double(), w.float().double(),
                                                                                1e-5, 0.0).bfloat16())


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_reference_is_a_complex_rotation_and_its_backward_the_transpose(interleaved):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, 8, generator=gen, dtype=F64)
    k = torch.randn(2, 1, 5, 8, generator=gen, dtype=F64)
    ang = torch.rand(2, 5, 4, generator=gen, dtype=F64) * 6
    ang = ang.repeat_interleave(2, -1) if interleaved else torch.cat([ang, ang], -1)
    cos, sin = ang.cos(), ang.sin()
    qo, ko = ref.rope(q, k, cos, sin, interleaved=interleaved)
    torch.testing.assert_close(qo, _rope_by_complex(q, cos[:, None], sin[:, None], interleaved))
    torch.testing.assert_close(ko, _rope_by_complex(k, cos[:, None], sin[:, None], interleaved))
    # a general table (different angles in a pair): autograd of the reference equals the closed form
    cos, sin = torch.randn(5, 8, generator=gen, dtype=F64), torch.randn(5, 8, generator=gen, dtype=F64)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: ref.rope(a, b, cos, sin, interleaved=interleaved), (qr, kr))
    gq, gk = torch.randn(q.shape, generator=gen, dtype=F64), torch.randn(k.shape, generator=gen, dtype=F64)
    torch.autograd.backward(ref.rope(qr, kr, cos, sin, interleaved=interleaved), [gq, gk])
    dq, dk = rope_backward(gq, gk, cos, sin, interleaved)
    torch.testing.assert_close(dq, qr.grad)
    torch.testing.assert_close(dk, kr.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_cpu_builders_are_chosen_and_match_the_reference(dtype):
    assert ops.registry.chosen("rms_norm", "cpu").name == "cpu_rms_norm"
    assert ops.registry.chosen("rope", "cpu").name == "cpu_rope"
    from polyaccel.testing.conformance import opcases_model

    opcases_model.check_rms_norm(ops.resolve("rms_norm", "cpu"), torch.device("cpu"), dtype)
    opcases_model.check_rope(ops.resolve("rope", "cpu"), torch.device("cpu"), dtype)
    # the cpu builder's backward keeps x and one rstd per row, not the reference's fp32 intermediates
    x = torch.randn(4, 8, dtype=dtype, requires_grad=True)
    y = cpu_ops.rms_norm(x, torch.ones(8, dtype=dtype), 1e-6)
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert sum(t.numel() for t in saved) == 4 * 8 + 8 + 4


def _refuses(match, fn, *args, **kw):
    with pytest.raises(OpArgumentError, match=match):
        fn(*args, **kw)


@pytest.fixture
def no_builder(monkeypatch):
    """Any builder lookup fails the test: the contract must refuse first."""
    from polyaccel.ops import calls_model

    def boom(*a, **k):
        raise AssertionError("a builder was resolved for a call the contract refuses")

    monkeypatch.setattr(calls_model._RUNTIME.ops, "resolve", boom)


def test_rms_norm_contract_refusals(no_builder):
    x, w = torch.randn(3, 8), torch.randn(8)
    f = ops.rms_norm
    _refuses("eps=nan", f, x, w, math.nan)
    _refuses("eps=-1e-06", f, x, w, -1e-6)
    _refuses("eps=inf", f, x, w, math.inf)
    _refuses("eps must be a real number, got a tensor", f, x, w, torch.tensor(1e-6))
    _refuses("offset=nan", f, x, w, offset=math.nan)
    _refuses("offset=inf", f, x, w, offset=math.inf)
    _refuses("offset=1.0 with weight=None", f, x, None, offset=1.0)
    _refuses(r"weight has shape \(7,\) but x's last dimension is 8", f, x, torch.randn(7))
    _refuses(r"weight has shape \(1, 8\)", f, x, torch.randn(1, 8))
    _refuses("x has shape \\(3, 0\\)", f, torch.randn(3, 0), torch.randn(0))
    _refuses("x has shape \\(\\)", f, torch.tensor(1.0), None)
    _refuses("dtype torch.int64", f, torch.ones(3, 8, dtype=torch.int64), None)
    _refuses("weight is a torch.strided tensor of dtype torch.int32", f, x, torch.ones(8, dtype=torch.int32))
    _refuses("x must be a tensor", f, [1.0, 2.0], None)
    _refuses("weight is on meta but x is on cpu", f, x, torch.empty(8, device="meta"))


def test_rope_contract_refusals(no_builder):
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    f = ops.rope
    _refuses("head_dim 7 is odd", f, torch.randn(2, 4, 5, 7), torch.randn(2, 2, 5, 7), torch.randn(5, 7),
             torch.randn(5, 7))
    _refuses("must be 4-D", f, q[0], k[0], cos, sin)
    _refuses("differ in batch, seq or head_dim", f, q, torch.randn(2, 2, 6, 8), cos, sin)
    _refuses("q is torch.float32 but k is torch.bfloat16", f, q, k.bfloat16(), cos, sin)
    _refuses("cos is torch.float32 but sin is torch.float16", f, q, k, cos, sin.half())
    _refuses(r"cos/sin have shape \(6, 8\)", f, q, k, torch.randn(6, 8), torch.randn(6, 8))
    _refuses(r"cos/sin have shape \(3, 5, 8\)", f, q, k, torch.randn(3, 5, 8), torch.randn(3, 5, 8))
    _refuses(r"cos/sin have shape \(2, 1, 5, 8\)", f, q, k, torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8))
    _refuses(r"cos \(5, 8\) and sin \(1, 5, 8\) differ", f, q, k, cos, sin[None])
    _refuses("interleaved must be a bool", f, q, k, cos, sin, interleaved=1)
    _refuses("sin is on meta but q is on cpu", f, q, k, cos, torch.empty(5, 8, device="meta"))
    _refuses("cos/sin require grad", f, q, k, cos.requires_grad_(), sin)
    _refuses("dtype torch.int32", f, q.int(), k.int(), cos, sin)
