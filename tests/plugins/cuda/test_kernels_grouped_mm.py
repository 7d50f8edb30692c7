"""Triton grouped_mm (forward and backward) and the torch._grouped_mm wrapper against float64 references."""

from __future__ import annotations

import importlib

import pytest
import torch
from polyaccel.ops.reference.grouped_mm import grouped_mm as reference
from polyaccel.plugins.cuda.kernels import grouped_mm as kg

# (the package's ``grouped_mm`` attribute is the reference function, not this module)
reference_module = importlib.import_module("polyaccel.ops.reference.grouped_mm")

#: small tiles: few programs under the interpreter, and every masking path at small sizes
SMALL = kg.TileConfig(16, 16, 16, 4, 1)

CASES = [
    # (tokens, in, out, cumulative offsets): uneven experts, empty ones (first, middle, last), rows past the end
    (37, 40, 24, [0, 5, 5, 20, 30, 30]),
    (20, 32, 16, [20]),
    (33, 48, 17, [9, 33]),
]


def _f64_forward_and_grads(x, w, offsets, grad_out):
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    out = reference(xd, wd, offsets)
    out.backward(grad_out.double())
    return out.detach(), xd.grad, wd.grad


def _check(got, want, dtype, k, what):
    """fp32 accumulation error, plus one bf16 ulp for bf16 results (the interpreter truncates)."""
    err = (got.double() - want).abs()
    scale = want.abs().max().clamp_min(1.0)
    bound = 1e-5 * scale * (k ** 0.5) + (0 if dtype == torch.float32 else
                                          2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7))
    if not bool((err <= bound).all()):
        raise AssertionError(f"{what}: max excess {float((err - bound).max()):.3e}, max error {float(err.max()):.3e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}K{c[1]}N{c[2]}E{len(c[3])}")
def test_triton_forward_and_backward_match_float64(case, dtype):
    t, k, n, offs = case
    gen = torch.Generator().manual_seed(t * k + n)
    x = torch.randn(t, k, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(len(offs), k, n, generator=gen).to(dtype).requires_grad_()
    offsets = torch.tensor(offs, dtype=torch.int64)
    grad_out = torch.randn(t, n, generator=gen).to(dtype)
    out = kg.grouped_mm(x, w, offsets, config=SMALL, wgrad_config=SMALL)
    out.backward(grad_out)
    want, want_dx, want_dw = _f64_forward_and_grads(x, w, offsets, grad_out)
    assert out.dtype == dtype and out.shape == (t, n)
    assert bool((out[offs[-1]:] == 0).all()), "rows past the last offset must be zero"
    _check(out, want, dtype, k, "out")
    _check(x.grad, want_dx, dtype, n, "dx")
    _check(w.grad, want_dw, dtype, t, "dw")
    for e in range(len(offs)):
        if offs[e] == (offs[e - 1] if e else 0):
            assert bool((w.grad[e] == 0).all()), f"expert {e} has no rows: its gradient must be zero"


def test_int32_offsets_even_k_and_default_tiles():
    """int32 offsets; K a multiple of BK (the unmasked loop); the GPU default tile sizes on a small problem."""
    x = torch.randn(40, 64)
    w = torch.randn(3, 64, 24)
    offsets = torch.tensor([10, 25, 38], dtype=torch.int32)
    want = reference(x.double(), w.double(), offsets)
    _check(kg.grouped_mm_forward(x, w, offsets, config=SMALL), want, torch.float32, 64, "even K")
    _check(kg.grouped_mm_forward(x, w, offsets), want, torch.float32, 64, "default tiles")


def test_no_experts_and_no_tokens():
    assert bool((kg.grouped_mm(torch.randn(5, 16), torch.randn(0, 16, 8), torch.empty(0, dtype=torch.int64),
                               config=SMALL) == 0).all())
    out = kg.grouped_mm(torch.randn(0, 16), torch.randn(2, 16, 8), torch.zeros(2, dtype=torch.int64), config=SMALL)
    assert out.shape == (0, 8)


def test_offsets_are_clamped_in_the_kernel_when_host_checks_are_skipped(monkeypatch):
    """During CUDA graph capture the host cannot read the offsets: bad ones must not reach out of bounds."""
    monkeypatch.setattr(kg, "_capturing", lambda t: True)
    x, w = torch.randn(20, 16), torch.randn(2, 16, 16)
    out = kg.grouped_mm_forward(x, w, torch.tensor([5, 1000]), config=SMALL)  # 1000 > 20 rows
    want = reference(x.double(), w.double(), torch.tensor([5, 20]))
    _check(out, want, torch.float32, 16, "clamped offsets")


@pytest.mark.parametrize("offsets,match", [
    ([5, 3], "non-decreasing"),
    ([5, 30], "exceeds"),
    ([5], "one entry per expert"),
])
def test_bad_offsets_raise(offsets, match):
    with pytest.raises(ValueError, match=match):
        kg.grouped_mm(torch.randn(20, 16), torch.randn(2, 16, 8), torch.tensor(offsets))


def test_bad_dtypes_raise():
    with pytest.raises(ValueError, match="weight is"):
        kg.grouped_mm(torch.randn(4, 16), torch.randn(1, 16, 8, dtype=torch.float64), torch.tensor([4]))
    with pytest.raises(ValueError, match="Triton kernel takes"):
        kg.grouped_mm_forward(torch.randn(4, 16, dtype=torch.float64), torch.randn(1, 16, 8, dtype=torch.float64),
                              torch.tensor([4]))
    with pytest.raises(ValueError, match="int32 or int64"):
        kg.grouped_mm(torch.randn(4, 16), torch.randn(1, 16, 8), torch.tensor([4.0]))


@pytest.mark.parametrize("capturing", [False, True])
def test_torch_grouped_mm_wrapper_zeroes_rows_past_the_end_both_ways(capturing, monkeypatch):
    """torch._grouped_mm leaves rows past the last offset unwritten; the wrapper zeroes them (fwd and dx). While
    capturing a graph it reads nothing back to the host and zeroes them with the end read on the device."""
    if capturing:
        monkeypatch.setattr(kg, "_capturing", lambda t: True)
        monkeypatch.setattr(kg, "last_offset", lambda *a: pytest.fail("host read while capturing"))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(30, 32, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(3, 32, 16, generator=gen).bfloat16().requires_grad_()
    offsets = torch.tensor([4, 4, 21])
    grad_out = torch.randn(30, 16, generator=gen).bfloat16()
    assert kg.torch_grouped_mm_applies(x, w)[0]
    out = kg.torch_grouped_mm(x, w, offsets)
    out.backward(grad_out)
    want, want_dx, want_dw = _f64_forward_and_grads(x, w, offsets, grad_out)
    assert bool((out[21:] == 0).all()) and bool((x.grad[21:] == 0).all())
    _check(out, want, torch.bfloat16, 32, "out")
    _check(x.grad, want_dx, torch.bfloat16, 16, "dx")
    _check(w.grad, want_dw, torch.bfloat16, 30, "dw")


def test_torch_grouped_mm_without_gradients_is_the_same_product_with_no_autograd_node():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(30, 32, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(3, 32, 16, generator=gen).bfloat16().requires_grad_()
    offsets = torch.tensor([4, 9, 21])
    with_grad = kg.torch_grouped_mm(x, w, offsets)
    with torch.no_grad():
        plain = kg.torch_grouped_mm(x, w, offsets)
    detached = kg.torch_grouped_mm(x.detach(), w.detach(), offsets)
    assert with_grad.grad_fn is not None and plain.grad_fn is None and detached.grad_fn is None
    assert torch.equal(plain, with_grad.detach()) and torch.equal(detached, plain)
    assert bool((plain[21:] == 0).all())
    _check(plain, reference(x.detach().double(), w.detach().double(), offsets), torch.bfloat16, 32, "no grad")


def test_torch_grouped_mm_weight_gradient_keeps_a_transposed_parameters_layout():
    """Experts stored [E, N, K] and passed as a transposed view: dw is right and lands contiguous in the
    parameter's layout (no strided copy when it accumulates)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(30, 32, generator=gen).bfloat16().requires_grad_()
    param = torch.randn(3, 16, 32, generator=gen).bfloat16().requires_grad_()
    offsets = torch.tensor([9, 9, 26])
    grad_out = torch.randn(30, 16, generator=gen).bfloat16()
    weight = param.transpose(1, 2)
    dx, dw = torch.autograd.grad(kg.torch_grouped_mm(x, weight, offsets), (x, weight), grad_out)
    _, want_dx, want_dw = _f64_forward_and_grads(x, weight, offsets, grad_out)
    assert dw.stride() == weight.stride()
    _check(dw, want_dw, torch.bfloat16, 30, "dw")
    _check(dx, want_dx, torch.bfloat16, 16, "dx")


def test_offsets_are_checked_on_the_host_at_every_call_unless_marked(monkeypatch):
    """Offsets that passed a check are checked again at the next call (a NumPy view writes them without bumping
    the version counter); offsets marked valid by construction are not read, and their int32 copy is kept for the
    layer's second GEMM."""
    from polyaccel.ops import offsets as known_offsets

    calls = []
    real = reference_module._checked_on_host
    monkeypatch.setattr(reference_module, "_checked_on_host", lambda off, rows: calls.append(rows) or real(off, rows))
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(12, 16, generator=gen).bfloat16()
    w = torch.randn(2, 16, 16, generator=gen).bfloat16()
    offsets = torch.tensor([5, 12])
    first = kg.torch_grouped_mm(x, w, offsets)
    second = kg.torch_grouped_mm(first, w, offsets)
    assert len(calls) == 2
    want = reference(reference(x.double(), w.double(), offsets).bfloat16().double(), w.double(), offsets)
    _check(second, want, torch.bfloat16, 32, "second call")
    calls.clear()
    offsets.numpy()[:] = [13, 12]  # behind the version counter: still checked
    with pytest.raises(ValueError, match="non-decreasing"):
        kg.torch_grouped_mm(x, w, offsets)
    marked = known_offsets.mark_complete(torch.tensor([5, 12]), 12)
    kg.torch_grouped_mm(x, w, marked)
    off32 = kg._last_int32[2]
    assert off32.dtype == torch.int32 and off32.tolist() == [5, 12]
    out = kg.torch_grouped_mm(x, w, marked)
    assert len(calls) == 1 and kg._last_int32[2] is off32  # the second GEMM of a layer reuses the copy
    _check(out, reference(x.double(), w.double(), marked), torch.bfloat16, 16, "marked")
    calls.clear()
    marked[0] = 9  # in place: the mark no longer holds; checked and converted again, and the product follows
    out = kg.torch_grouped_mm(x, w, marked)
    assert len(calls) == 1 and kg._last_int32[2] is off32
    _check(out, reference(x.double(), w.double(), marked), torch.bfloat16, 16, "after the change")


def test_torch_grouped_mm_wrapper_sends_what_torch_does_not_take_to_the_reference():
    x, w = torch.randn(10, 12), torch.randn(2, 12, 8)
    ok, why = kg.torch_grouped_mm_applies(x, w)
    assert not ok and "bfloat16" in why
    out = kg.torch_grouped_mm(x, w, torch.tensor([3, 7]))
    _check(out, reference(x.double(), w.double(), torch.tensor([3, 7])), torch.float32, 12, "fp32 via reference")
    ok, why = kg.torch_grouped_mm_applies(x.bfloat16(), w.bfloat16())
    assert not ok and "multiples of 8" in why


def test_float64_goes_to_the_reference_with_gradients():
    x = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 16, 8, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([4, 7])
    out = kg.grouped_mm(x, w, offsets)
    want = reference(x.detach(), w.detach(), offsets)
    assert out.dtype == torch.float64 and torch.allclose(out, want, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    assert x.grad is not None and w.grad is not None and bool((x.grad[7:] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offsets", [[0, 0], [3, 17], [40, 70], [70, 70], []])
@pytest.mark.parametrize("transposed", [False, True])
def test_rows_past_the_last_offset_are_zeroed_with_the_end_read_on_the_device(dtype, offsets, transposed):
    gen = torch.Generator().manual_seed(len(offsets) + sum(offsets))
    t = (torch.rand(70, 200, generator=gen) + 0.5).to(dtype)  # no zero anywhere before
    if transposed:  # a strided [70, 200] view
        t = (torch.rand(200, 70, generator=gen) + 0.5).to(dtype).t()
    want = t.clone()
    end = offsets[-1] if offsets else 0
    want[end:] = 0
    got = kg.zero_rows_past_on_device(t, torch.tensor(offsets, dtype=torch.int64))
    assert got is t and torch.equal(t, want)
