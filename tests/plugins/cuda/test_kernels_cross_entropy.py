"""Triton chunk kernels of linear_cross_entropy under TRITON_INTERPRET=1 against float64 math."""

from __future__ import annotations

import pytest
import torch
from polyaccel.ops import chunked_loss
from polyaccel.ops import reference as ref
from polyaccel.plugins.cuda.kernels import cross_entropy as kce
from polyaccel.testing.conformance import opcases_loss

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # -inf - -inf, masked


def test_stats_and_grad_kernels_match_torch_over_several_column_blocks():
    gen = torch.Generator().manual_seed(0)
    v = kce.BLOCK_V + 905  # two blocks of columns, the second one partial
    z = torch.randn(4, v, generator=gen, dtype=torch.float64) * 5
    target = torch.tensor([3, -1, v - 1, kce.BLOCK_V])
    lse, picked = kce.TritonChunkKernels.stats(z, target)
    want_lse, want_picked = chunked_loss.TorchChunkKernels.stats(z, target)
    torch.testing.assert_close(lse, want_lse, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(picked, want_picked, rtol=0, atol=0)
    coef, scale = torch.rand(4, generator=gen, dtype=torch.float64), torch.rand(4, generator=gen, dtype=torch.float64)
    got = kce.TritonChunkKernels.grad_(z.clone(), lse, target, coef, scale)
    want = chunked_loss.TorchChunkKernels.grad_(z.clone(), lse, target, coef, scale)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)
    # 16-bit logits: the gradient is written over them, in their dtype
    zb = z.bfloat16()
    out = kce.TritonChunkKernels.grad_(zb, *kce.TritonChunkKernels.stats(zb, target), coef.float(), scale.float())
    assert out.data_ptr() == zb.data_ptr() and out.dtype == torch.bfloat16


def test_the_fused_kernel_equals_stats_then_grad():
    gen = torch.Generator().manual_seed(4)
    v = kce.FUSED_BLOCK + 311  # two steps of columns, the second partial
    z = torch.randn(5, v, generator=gen, dtype=torch.float64) * 4
    target = torch.tensor([0, -1, v - 1, kce.FUSED_BLOCK, 17])
    scale = torch.rand(5, generator=gen, dtype=torch.float64) + 0.5
    scale[target < 0] = 0.0  # an ignored row weighs nothing in the loss (the loop's scale)
    want_lse, want_picked = chunked_loss.TorchChunkKernels.stats(z, target)
    for z_loss in (0.0, 1e-2):
        got, row_loss = z.clone(), torch.full((5,), float("nan"), dtype=torch.float64)
        kce.TritonChunkKernels.stats_grad_(got, target, scale, z_loss, row_loss)
        coef = scale * (1.0 + 2.0 * z_loss * want_lse)
        want = chunked_loss.TorchChunkKernels.grad_(z.clone(), want_lse, target, coef, scale)
        want_rows = torch.where(target >= 0, want_lse - want_picked + z_loss * want_lse ** 2, 0.0)
        torch.testing.assert_close(row_loss, want_rows, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    # an ignored row is written as zeros without being read (an inf or NaN there reaches no gradient)
    poisoned = z.clone()
    poisoned[1, ::7] = float("inf")
    poisoned[1, 3] = float("nan")
    kce.TritonChunkKernels.stats_grad_(poisoned, target, scale, 0.0, row_loss)
    assert torch.equal(poisoned[1], torch.zeros(v, dtype=torch.float64)) and float(row_loss[1]) == 0.0
    want = chunked_loss.TorchChunkKernels.grad_(z.clone(), want_lse, target, scale, scale)  # z_loss 0
    torch.testing.assert_close(poisoned[[0, 2, 3, 4]], want[[0, 2, 3, 4]], rtol=1e-12, atol=1e-15)
    # a column-strided chunk takes the two-kernel path, still in place
    zt, row_loss = z.t().contiguous().t(), torch.empty(5, dtype=torch.float64)
    kce.TritonChunkKernels.stats_grad_(zt, target, scale, 0.0, row_loss)
    torch.testing.assert_close(row_loss, torch.where(target >= 0, want_lse - want_picked, 0.0), rtol=1e-13,
                               atol=1e-13)
    torch.testing.assert_close(zt, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_scale_multiplies_unless_the_factor_is_exactly_one(dtype):
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(3, kce.SCALE_BLOCK + 77, generator=gen).to(dtype)
    same = g.clone()
    kce.TritonChunkKernels.scale_(same, torch.tensor(1.0))
    assert torch.equal(same, g)
    for factor in (2.5, 0.0, -1e-3):
        got = g.clone()
        kce.TritonChunkKernels.scale_(got, torch.tensor(factor))
        want = (g.double() * torch.tensor(factor).double()).to(dtype)  # the factor as handed: an fp32 scalar
        ulp = 0 if dtype == torch.float64 else 2**-7  # (the interpreter truncates fp32 -> bf16: one ulp)
        torch.testing.assert_close(got, want, rtol=ulp, atol=0)
    strided = g.clone().t()  # not contiguous: torch's in-place multiply
    kce.TritonChunkKernels.scale_(strided, torch.tensor(3.0))
    torch.testing.assert_close(strided, (g.double() * 3).to(dtype).t(), rtol=0, atol=0)


def test_a_loss_gradient_other_than_one_scales_every_gradient():
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(19, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(37, 8, generator=gen, dtype=torch.float64) / 3
    labels = torch.randint(0, 37, (19,), generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    (kce.linear_cross_entropy(*leaves, labels, chunk_size=6) * -0.75).backward()
    r = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    (ref.linear_cross_entropy(*r, labels) * -0.75).backward()
    for got, want in zip(leaves, r, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_op_matches_the_float64_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    for kw in ({}, {"z_loss": 1e-2, "chunk_size": 7, "bias": True}, {"reduction": "sum", "ignore_index": -1}):
        kw = dict(kw)
        with_bias = kw.pop("bias", False)
        n, h, v = 29, 8, 45
        hidden = torch.randn(n, h, generator=gen).to(dtype)
        weight = (torch.randn(v, h, generator=gen) / 3).to(dtype)
        bias = torch.randn(v, generator=gen).to(dtype) if with_bias else None
        labels = torch.randint(0, v, (n,), generator=gen)
        labels[::5] = kw.get("ignore_index", -100)
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias) if t is not None]
        loss = kce.linear_cross_entropy(leaves[0], leaves[1], labels, bias=leaves[2] if with_bias else None, **kw)
        loss.backward()
        r = [t.double().requires_grad_(True) for t in (hidden, weight, bias) if t is not None]
        want = ref.linear_cross_entropy(r[0], r[1], labels, bias=r[2] if with_bias else None, **kw)
        want.backward()
        mags = opcases_loss.linear_cross_entropy_bounds(*(t.detach() for t in r[:2]),
                                                        r[2].detach() if with_bias else None, labels, **kw)
        rtol, atol = opcases_loss.op_tolerances(dtype)
        for got, exp, mag in zip([loss, *(t.grad for t in leaves)], [want, *(t.grad for t in r)], mags, strict=False):
            err = (got.detach().double() - exp.detach()).abs()
            assert bool((err <= atol + rtol * mag).all()), f"{dtype} {kw}: error {float(err.max()):.3e}"


def test_all_ignored_rows_give_zero():
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    loss = kce.linear_cross_entropy(hidden, weight, torch.full((6,), -100))
    loss.backward()
    assert float(loss.detach()) == 0.0 and not hidden.grad.any() and not weight.grad.any()


def test_the_builder_is_registered_for_cuda_above_the_chunked_torch_one():
    from polyaccel.plugins.cuda import ops as cuda_ops

    rows = [b for b in cuda_ops.builders(["linear_cross_entropy"])]
    assert [b.name for b in rows] == ["triton_linear_cross_entropy"]
    from polyaccel.ops.builtin import CORE_TORCH_PRIORITY

    assert rows[0].priority > CORE_TORCH_PRIORITY and rows[0].load() is kce.linear_cross_entropy
