"""The Muon ops' conformance checks: the references pass, planted wrong builders FAIL naming what is wrong."""

from __future__ import annotations

import pytest
import torch
from polyaccel.ops import reference as ref
from polyaccel.ops.reference import muon
from polyaccel.testing.conformance import opcases_muon as om

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_references_pass(dtype):
    om.check_newton_schulz(ref.newton_schulz, CPU, dtype)
    om.check_fused_muon(ref.fused_muon, CPU, dtype)


def ns_default_coefficients(x, *, steps, coefficients, eps):
    return ref.newton_schulz(x, steps=steps, eps=eps)  # the bug: the coefficients are ignored


def ns_no_transpose_back(x, *, steps, coefficients, eps):
    tall = x.shape[-2] > x.shape[-1]
    out = ref.newton_schulz(x.mT.contiguous() if tall else x, steps=steps, coefficients=coefficients, eps=eps)
    return out.reshape(x.shape)  # the bug: the wide result is reshaped, not transposed back


def ns_batch_norm(x, *, steps, coefficients, eps):
    """The bug: one Frobenius norm over the whole batch instead of one per matrix."""
    a, b, c = coefficients
    tall = x.shape[-2] > x.shape[-1]
    X = (x.mT if tall else x).float()
    X = X / torch.linalg.vector_norm(X).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return (X.mT if tall else X).to(x.dtype).contiguous()


@pytest.mark.parametrize("builder,what", [
    (ns_default_coefficients, r"coefficients \(1.875, -1.25, 0.375\): relative Frobenius error"),
    (ns_no_transpose_back, r"shape \((13, 6|2, 12, 4|40, 16)\).*relative Frobenius error"),
    (ns_batch_norm, r"newton_schulz torch.bfloat16 shape \((3, 7, 11|2, 12, 4|4, 8, 8)\).*relative Frobenius"),
])
def test_wrong_newton_schulz_builders_fail(builder, what):
    with pytest.raises(AssertionError, match=what):
        om.check_newton_schulz(builder, CPU, torch.bfloat16)


def muon_no_head_split(*args, head_splits=None, **kw):
    ref.fused_muon(*args, **kw)  # the bug: every tensor orthogonalized whole


def muon_no_lr_scale(*args, lr_adjustment="original", **kw):
    ref.fused_muon(*args, lr_adjustment="none", **kw)  # the bug: the aspect-ratio scale is dropped


def muon_plain_momentum(params, grads, bufs, *, nesterov=True, **kw):
    ref.fused_muon(params, grads, bufs, nesterov=False, **kw)  # the bug: Nesterov ignored


def muon_ns_in_fp32(*args, ns_dtype=torch.bfloat16, **kw):
    ref.fused_muon(*args, ns_dtype=torch.float32, **kw)  # not a bug at a bf16 bound; a bug at fp64's


@pytest.mark.parametrize("builder,dtype,what", [
    (muon_no_head_split, torch.float32, r"head splits \[None, None, \(0, 5\).*param 2 shape \(15, 15\)"),
    (muon_no_lr_scale, torch.float32, r"'lr_adjustment': 'original'.*param 0 shape \(13, 7\)"),
    (muon_plain_momentum, torch.bfloat16, r"'nesterov': True.*param \d"),
    (muon_ns_in_fp32, torch.float64, r"ns_dtype torch.float64.*relative|ns_dtype torch.float64.*off the reference"),
])
def test_wrong_fused_muon_builders_fail(builder, dtype, what):
    with pytest.raises(AssertionError, match=what):
        om.check_fused_muon(builder, CPU, dtype)


def test_float16_iterates_in_float16_after_scaling_in_float32():
    """ns_dtype=float16: the update is scaled in fp32 (no overflow at 1e6) and then iterated in fp16, not fp32."""
    # seeded: the two fp16 iterations round apart, up to the bound on about one draw in five (the test's result
    # depended on the global generator's state, so on which tests ran before it in the process)
    torch.manual_seed(0)
    u = torch.randn(8, 12) * 1e6
    got = muon.orthogonalized_update(u, ns_dtype=torch.float16)
    X = (u / u.norm()).half()
    X = X / X.float().norm().half()
    a, b, c = muon.NS_COEFFICIENTS
    for _ in range(muon.NS_STEPS):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    assert got.isfinite().all()
    assert not torch.equal(got, muon.orthogonalized_update(u, ns_dtype=torch.float32))
    torch.testing.assert_close(got, X.float(), rtol=0, atol=5e-3)
