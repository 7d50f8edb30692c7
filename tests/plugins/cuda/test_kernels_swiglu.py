"""Triton SwiGLU forward/backward under TRITON_INTERPRET=1 against float64 math."""

from __future__ import annotations

import pytest
import torch
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
    from polyaccel.ops.reference.swiglu import halves_of

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
