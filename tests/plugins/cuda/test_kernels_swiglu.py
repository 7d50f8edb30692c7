"""Triton SwiGLU and weighted SwiGLU forward/backward under TRITON_INTERPRET=1 against float64 math."""

from __future__ import annotations

import pytest
import torch
from polyaccel.ops import reference as ref
from polyaccel.ops.reference.swiglu import halves_of
from polyaccel.plugins.cuda.kernels import swiglu as ks


def _bound(want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Allowed |error| vs float64: fp32 rounding, or one bf16/fp16 ulp (the interpreter truncates)."""
    mag = want.abs()
    if dtype == torch.float32:
        return mag * 1e-6 + 1e-7
    mant = 7 if dtype == torch.bfloat16 else 10
    ulp = 2.0 ** (torch.floor(torch.log2(mag.clamp_min(1e-30))) - mant)
    return ulp * 1.01 + 1e-6


def _f64(gate, up, go):
    g, u = gate.double(), up.double()
    sig = torch.sigmoid(g)
    out = g * sig * u
    d_gate = go.double() * u * sig * (1 + g * (1 - sig))
    d_up = go.double() * g * sig
    return out, d_gate, d_up


def _check(got, want, dtype, what):
    err = (got.double() - want).abs()
    bound = _bound(want, dtype)
    if not bool((err <= bound).all()):
        i = int((err - bound).argmax())
        raise AssertionError(f"{what}: max excess {float((err - bound).max()):.3e} at {i}: "
                             f"got {got.reshape(-1)[i].item()}, want {want.reshape(-1)[i].item()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 1001), (7,), (2, 3, 129)])
def test_forward_and_backward_match_float64(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    gate = (torch.randn(shape, generator=gen) * 4).to(dtype).requires_grad_()
    up = torch.randn(shape, generator=gen).to(dtype).requires_grad_()
    go = torch.randn(shape, generator=gen).to(dtype)
    out = ks.swiglu(gate, up)
    out.backward(go)
    want_out, want_dg, want_du = _f64(gate.detach(), up.detach(), go)
    assert out.dtype == dtype and out.shape == gate.shape
    _check(out, want_out, dtype, "forward")
    _check(gate.grad, want_dg, dtype, "d_gate")
    _check(up.grad, want_du, dtype, "d_up")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_halves_of_one_projection_are_read_in_place(dtype):
    """gate and up as the two halves of an [N, 2F] tensor (MoE experts' h.chunk(2, -1)): no copy, same math."""
    gen = torch.Generator().manual_seed(11)
    h = (torch.randn(37, 2 * 130, generator=gen) * 3).to(dtype).requires_grad_()
    gate, up = h.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    assert ks._rows(gate)[0].data_ptr() == gate.data_ptr() and ks._rows(gate)[1] == 260
    go = torch.randn(37, 130, generator=gen).to(dtype)
    out = ks.swiglu(gate, up)
    out.backward(go)
    want_out, want_dg, want_du = _f64(gate.detach(), up.detach(), go)
    _check(out, want_out, dtype, "forward")
    _check(h.grad[:, :130], want_dg, dtype, "d_gate")
    _check(h.grad[:, 130:], want_du, dtype, "d_up")
    # a layout that is not rows of unit stride is copied first and still right
    t = torch.randn(130, 37, generator=gen).to(dtype).t()
    _check(ks.swiglu_forward(t, t), _f64(t, t, t)[0], dtype, "transposed input")


def test_many_programs_with_a_partial_last_block():
    """A small block forces several programs and a masked tail."""
    n = 5 * 256 + 37
    gate, up, go = torch.randn(n) * 3, torch.randn(n), torch.randn(n)
    out = ks.swiglu_forward(gate, up, block=256, num_warps=4)
    dg, du = ks.swiglu_backward(go, gate, up, block=256, num_warps=4)
    want_out, want_dg, want_du = _f64(gate, up, go)
    for got, want, what in ((out, want_out, "out"), (dg, want_dg, "d_gate"), (du, want_du, "d_up")):
        _check(got, want, torch.float32, what)


def test_non_contiguous_inputs_and_empty_tensors():
    base = torch.randn(64, 48) * 3
    gate, up = base.t(), torch.randn(64, 48).t()  # transposed views
    _check(ks.swiglu_forward(gate, up), _f64(gate, up, gate)[0], torch.float32, "transposed forward")
    empty = torch.empty(0, 5)
    assert ks.swiglu_forward(empty, empty).shape == (0, 5)
    dg, du = ks.swiglu_backward(empty, empty, empty)
    assert dg.shape == du.shape == (0, 5)


def test_mismatched_inputs_raise():
    with pytest.raises(ValueError, match="differ in shape"):
        ks.swiglu(torch.randn(4), torch.randn(5))
    with pytest.raises(ValueError, match="same dtype"):
        ks.swiglu(torch.randn(4), torch.randn(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="grad_out"):
        ks.swiglu_backward(torch.randn(3), torch.randn(4), torch.randn(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_of_the_halves_of_one_tensor_writes_the_halves_of_one_gradient(dtype):
    h = torch.randn(5, 2 * 37).to(dtype)
    gate, up = h.chunk(2, dim=-1)
    go = torch.randn(5, 37).to(dtype)
    d_gate, d_up = ks.swiglu_backward(go, gate, up)
    whole = halves_of(d_gate, d_up)
    assert whole is not None and whole.shape == h.shape and whole.data_ptr() != h.data_ptr()
    _, want_gate, want_up = _f64(gate, up, go)
    _check(whole[:, :37], want_gate, dtype, "d gate half")
    _check(whole[:, 37:], want_up, dtype, "d up half")
    # two unrelated tensors: contiguous gradients of their own
    d_gate, d_up = ks.swiglu_backward(go, gate.contiguous(), up.contiguous())
    assert halves_of(d_gate, d_up) is None and d_gate.is_contiguous() and d_up.is_contiguous()
    _check(d_gate, want_gate, dtype, "d gate")


# ------------------------------------------------------------------------- weighted_swiglu
def _weighted_inputs(n, f, dtype, w_dtype=None, halves=False, seed=0):
    """Random gate, up (the halves of one [n, 2f] tensor when ``halves``), weights and grad_out."""
    gen = torch.Generator().manual_seed(seed)
    if halves:
        gate, up = (torch.randn(n, 2 * f, generator=gen) * 3).to(dtype).chunk(2, dim=-1)
    else:
        gate = (torch.randn(n, f, generator=gen) * 3).to(dtype)
        up = torch.randn(n, f, generator=gen).to(dtype)
    weights = (torch.rand(n, generator=gen) + 0.5).to(w_dtype or dtype)
    go = torch.randn(n, f, generator=gen).to(dtype)
    return gate, up, weights, go


def _weighted_f64(gate, up, weights, go):
    """(out, d_gate, d_up, d_weights) by the reference in float64, and the scales of d_gate's and d_weights' terms.

    fp32 rounding is relative to those scales, not to the results: ``1 + g * (1 - sig)`` cancels near
    g = -1.28 and the sum over F cancels too.
    """
    g, u, w, o = gate.double(), up.double(), weights.double(), go.double()
    out = ref.weighted_swiglu_forward(g, u, w)
    d_gate, d_up, d_w = ref.weighted_swiglu_backward(o, g, u, w, True)
    sig = torch.sigmoid(g)
    scales = ((o * w[:, None] * u * sig).abs() * (1 + g.abs()), (o * g * sig * u).abs().sum(dim=1))
    return (out, d_gate, d_up, d_w), scales


def _check_weighted(got, want, dtype, what, slack=None):
    """_check, with fp64 bounds too and ``slack`` added (the fp32 sum's rounding for d_weights)."""
    bound = want.abs() * 1e-12 + 1e-13 if dtype == torch.float64 else _bound(want, dtype)
    if slack is not None:
        bound = bound + slack
    err = (got.double() - want).abs()
    if not bool((err <= bound).all()):
        i = int((err - bound).argmax())
        raise AssertionError(f"{what}: max excess {float((err - bound).max()):.3e} at {i}: "
                             f"got {got.reshape(-1)[i].item()}, want {want.reshape(-1)[i].item()}")


def _check_all_weighted(got, want, dtype, w_dtype):
    (out, d_gate, d_up, d_w), ((want_out, want_dg, want_du, want_dw), (dg_scale, dw_scale)) = got, want
    eps = 1e-14 if dtype == torch.float64 else 1e-6
    _check_weighted(out, want_out, dtype, "forward")
    _check_weighted(d_gate, want_dg, dtype, "d_gate", slack=dg_scale * eps)
    _check_weighted(d_up, want_du, dtype, "d_up")
    _check_weighted(d_w, want_dw, w_dtype, "d_weights", slack=dw_scale * eps)


@pytest.mark.parametrize("halves", [False, True], ids=["contiguous", "halves"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_weighted_matches_float64_reference(dtype, halves):
    """37 rows of 1100 columns: a partial last forward block and two column chunks per backward row."""
    gate, up, weights, go = _weighted_inputs(37, 1100, dtype, halves=halves, seed=3)
    out = ks.weighted_swiglu_forward(gate, up, weights)
    d_gate, d_up, d_w = ks.weighted_swiglu_backward(go, gate, up, weights, True)
    assert out.dtype == d_gate.dtype == d_up.dtype == d_w.dtype == dtype and out.is_contiguous()
    assert (halves_of(d_gate, d_up) is not None) == halves
    if not halves:
        assert d_gate.is_contiguous() and d_up.is_contiguous()
    _check_all_weighted((out, d_gate, d_up, d_w), _weighted_f64(gate, up, weights, go), dtype, dtype)


def test_weighted_autograd_through_the_halves_of_one_projection():
    """The op as a builder returns it: gradients reach h (the split projection) and the weights."""
    gate, up, weights, go = _weighted_inputs(9, 70, torch.bfloat16, halves=True, seed=5)
    h = gate._base.clone().requires_grad_()
    weights.requires_grad_()
    g, u = h.chunk(2, dim=-1)
    out = ks.weighted_swiglu(g, u, weights)
    out.backward(go)
    want = _weighted_f64(gate, up, weights.detach(), go)
    _check_all_weighted((out, h.grad[:, :70], h.grad[:, 70:], weights.grad), want, torch.bfloat16, torch.bfloat16)


def test_weighted_fp32_weights_with_bf16_gate():
    gate, up, weights, go = _weighted_inputs(37, 130, torch.bfloat16, w_dtype=torch.float32, seed=7)
    out = ks.weighted_swiglu_forward(gate, up, weights)
    d_gate, d_up, d_w = ks.weighted_swiglu_backward(go, gate, up, weights, True)
    assert out.dtype == d_gate.dtype == torch.bfloat16 and d_w.dtype == torch.float32
    _check_all_weighted((out, d_gate, d_up, d_w), _weighted_f64(gate, up, weights, go), torch.bfloat16,
                        torch.float32)


def test_weighted_without_the_weights_gradient():
    gate, up, weights, go = _weighted_inputs(6, 300, torch.float32, seed=9)
    d_gate, d_up, d_w = ks.weighted_swiglu_backward(go, gate, up, weights, False)
    assert d_w is None
    (_, want_dg, want_du, _), (dg_scale, _) = _weighted_f64(gate, up, weights, go)
    _check_weighted(d_gate, want_dg, torch.float32, "d_gate", slack=dg_scale * 1e-6)
    _check_weighted(d_up, want_du, torch.float32, "d_up")
    # through autograd, weights that need no gradient get none
    gate.requires_grad_()
    ks.weighted_swiglu(gate, up, weights).backward(go)
    assert weights.grad is None
    _check_weighted(gate.grad, want_dg, torch.float32, "autograd d_gate", slack=dg_scale * 1e-6)


def test_weighted_small_blocks_give_many_programs_and_column_chunks():
    gate, up, weights, go = _weighted_inputs(5, 301, torch.float32, seed=13)
    out = ks.weighted_swiglu_forward(gate, up, weights, block=256, num_warps=4)
    grads = ks.weighted_swiglu_backward(go, gate, up, weights, True, max_block_f=64)
    _check_all_weighted((out, *grads), _weighted_f64(gate, up, weights, go), torch.float32, torch.float32)


def test_weighted_zero_rows_and_zero_columns():
    for n, f in ((0, 5), (0, 0), (4, 0)):
        gate = up = go = torch.empty(n, f)
        weights = torch.rand(n) + 0.5
        assert ks.weighted_swiglu_forward(gate, up, weights).shape == (n, f)
        d_gate, d_up, d_w = ks.weighted_swiglu_backward(go, gate, up, weights, True)
        assert d_gate.shape == d_up.shape == (n, f)
        assert torch.equal(d_w, torch.zeros(n))


def test_weighted_differs_from_plain_swiglu():
    """The weights are applied: plain swiglu's results fail the checks the weighted kernels pass."""
    gate, up, weights, go = _weighted_inputs(8, 200, torch.float32, seed=17)
    (want_out, want_dg, want_du, _), (dg_scale, _) = _weighted_f64(gate, up, weights, go)
    plain_dg, plain_du = ks.swiglu_backward(go, gate, up)
    for got, want, slack in ((ks.swiglu_forward(gate, up), want_out, None), (plain_dg, want_dg, dg_scale * 1e-6),
                             (plain_du, want_du, None)):
        with pytest.raises(AssertionError):
            _check_weighted(got, want, torch.float32, "plain swiglu", slack=slack)


def test_weighted_mismatched_inputs_raise():
    gate = up = torch.randn(4, 6)
    with pytest.raises(ValueError, match="one weight per row"):
        ks.weighted_swiglu(gate, up, torch.rand(5))
    with pytest.raises(ValueError, match="2-D"):
        ks.weighted_swiglu_forward(torch.randn(24), torch.randn(24), torch.rand(24))
    with pytest.raises(ValueError, match="grad_out"):
        ks.weighted_swiglu_backward(torch.randn(4, 5), gate, up, torch.rand(4), True)


def test_the_split_of_a_view_of_a_wider_projection_counts_as_halves_of_one_tensor():
    """AutoEP's dense experts split ``gu.view(T * E, 2F)`` of a ``[T, E * 2F]`` product: its gradient must
    still come back as one tensor (no concatenation), found from the layout, not from ``_base``."""
    gu = torch.randn(3, 4 * 2 * 5)  # T=3, E=4, F=5
    gate, up = gu.view(12, 10).chunk(2, dim=-1)
    whole = halves_of(gate, up)
    assert whole is not None and whole.shape == (12, 10) and torch.equal(whole, gu.view(12, 10))
    weights = torch.rand(12) + 0.5
    d_gate, d_up, _ = ks.weighted_swiglu_backward(torch.randn(12, 5), gate, up, weights, True)
    assert halves_of(d_gate, d_up) is not None
    # not halves: the wrong order, a wider row, two tensors
    assert halves_of(up, gate) is None
    assert halves_of(*torch.randn(4, 15)[:, :10].chunk(2, dim=-1)) is None
    assert halves_of(gate.contiguous(), up.contiguous()) is None


def test_swiglu_of_halves_is_the_checked_kernels_bit_for_bit():
    """The fused experts' entry points (gu [N, 2F] whole, no checks): the same numbers as swiglu_forward and
    swiglu_backward on gu's halves, over several programs with a masked tail, and right against float64."""
    gen = torch.Generator().manual_seed(21)
    gu = (torch.randn(9, 2 * 61, generator=gen) * 3).to(torch.bfloat16)
    go = torch.randn(9, 61, generator=gen).to(torch.bfloat16)
    gate, up = gu.chunk(2, dim=-1)
    out = ks.swiglu_of_halves(gu, block=256, num_warps=4)
    d_gu = ks.swiglu_of_halves_backward(go, gu, block=256, num_warps=4)
    assert torch.equal(out, ks.swiglu_forward(gate, up, block=256, num_warps=4))
    assert d_gu.shape == gu.shape and torch.equal(d_gu, halves_of(*ks.swiglu_backward(go, gate, up, block=256,
                                                                                       num_warps=4)))
    want_out, want_dg, want_du = _f64(gate, up, go)
    _check(out, want_out, torch.bfloat16, "forward")
    _check(d_gu[:, :61], want_dg, torch.bfloat16, "d gate half")
    _check(d_gu[:, 61:], want_du, torch.bfloat16, "d up half")
    empty = torch.empty(0, 8)
    assert ks.swiglu_of_halves(empty).shape == (0, 4)
    assert ks.swiglu_of_halves_backward(empty[:, :4], empty).shape == (0, 8)


def test_the_ops_check_their_arguments_once_before_their_node():
    """swiglu / weighted_swiglu refuse bad arguments before their autograd node (whose kernels then take them as
    checked); the public kernel functions still check theirs."""
    with pytest.raises(ValueError, match="weights must be a 1-D"):
        ks.weighted_swiglu(torch.randn(4, 3), torch.randn(4, 3), torch.randn(3))
    with pytest.raises(ValueError, match="2-D"):
        ks.weighted_swiglu(torch.randn(4), torch.randn(4), torch.randn(4))
    with pytest.raises(ValueError, match="on meta"):
        ks.swiglu(torch.randn(4), torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="floating-point"):
        ks.swiglu_forward(torch.ones(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32))


def test_host_integer_helpers_match_triton():
    import triton

    for n in [*range(1, 300), 1023, 1024, 1025, 4095, 4096, 4097, 2**31 - 1, 2**31, 2**31 + 1, 3 * 2**40]:
        assert ks._next_power_of_2(n) == triton.next_power_of_2(n), n
        for block in (256, 4096):
            assert ks._grid(n, block) == (triton.cdiv(n, block),), (n, block)
