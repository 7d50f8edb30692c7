"""Conformance cases of the fused expert ops, ``moe_gate_up`` and ``moe_down_combine``.

Each check runs the builder forward and backward on fresh random inputs on the device and the
core reference on float64 host copies. The weights are passed as AutoEP passes them, transposed
views of transformers' ``[E, 2F, H]`` / ``[E, H, F]`` parameters, and as contiguous tensors.
Every result and gradient must lie within the dtype's bounds of the reference, measured
against the same chain on absolute values plus the reference's own magnitude (a GEMM's
rounding error scales with the sum of absolute products, not with a cancelled result). A wrong
epilogue (SiLU on the up half, the router weight left out, a slot dropped) is off by the
size of the result and fails.
"""

from __future__ import annotations

import torch
from polyaccel.ops import reference as ref

from .opcases import _dev, op_tolerances

#: (rows per expert, tail rows past the last offset, tokens, k, H, F): uneven experts, an expert with no
#: rows (first, middle, last), rows past the last offset, one slot (a permutation) and several. The two k = 2
#: cases share H with each other and with a gather_sum case: their combine's kernels compile once on a GPU
MOE_CASES = [
    ([5, 0, 7, 2], 4, 6, 3, 24, 10),
    ([0, 9], 0, 9, 1, 16, 8),
    ([3, 3, 0], 2, 4, 2, 33, 5),
    ([0, 0, 0], 4, 2, 2, 33, 3),
    ([], 0, 0, 2, 8, 4),
]


def _routing(counts, tail, T, k):
    assert sum(counts) + tail == T * k
    index = torch.randperm(T * k).view(T, k)
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0) if counts else torch.zeros(0, dtype=torch.int64)
    return index, offsets


def _weight(E, a, b, dtype, transposed: bool) -> torch.Tensor:
    """[E, a, b]: a contiguous tensor, or the transposed view of an [E, b, a] one (a parameter's layout)."""
    if transposed:
        return torch.randn(E, b, a).div(a ** 0.5).to(dtype).transpose(1, 2)
    return torch.randn(E, a, b).div(a ** 0.5).to(dtype)


def _bound_check(got, want, mag, dtype, where):
    """Within the bounds of ``want``; a missing gradient counts as zeros (the reference's own, when all rows
    lie past the last offset: its ``grouped_mm`` then builds no graph)."""
    rtol, atol = op_tolerances(dtype)
    if got is None:
        got = torch.zeros_like(want)
    assert tuple(got.shape) == tuple(want.shape), f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not want.numel():
        return
    err = (got.detach().to("cpu", torch.float64) - want).abs()
    bound = atol + rtol * (mag.abs() + want.abs())
    worst = float((err - bound).max())
    assert worst <= 0, f"{where}: error exceeds the bound by {worst:.3e} (max error {float(err.max()):.3e})"


def _reference(fn, leaves, grad, absolute: bool):
    lv = [(t.detach().to(torch.float64, copy=True).abs() if absolute else t.detach().to(torch.float64, copy=True))
          .requires_grad_(True) if t is not None else None for t in leaves]
    out = fn(*lv)
    if out.requires_grad:
        out.backward(grad.double().abs() if absolute else grad.double())
    return out.detach(), [(t.grad if t.grad is not None else torch.zeros_like(t)) if t is not None else None
                          for t in lv]


def _backward(out, grad):
    if out.requires_grad:
        out.backward(grad)


def check_moe_gate_up(fn, device: torch.device, dtype: torch.dtype) -> None:
    for counts, tail, T, k, H, F in MOE_CASES:
        for transposed in (True, False):
            for int_dtype in (torch.int64, torch.int32):
                where = (f"moe_gate_up {dtype} rows/expert {counts} tail {tail} tokens {T} k {k} H={H} F={F} "
                         f"{'transposed' if transposed else 'contiguous'} weight, {int_dtype}")
                index, offsets = _routing(counts, tail, T, k)
                x = torch.randn(T, H).to(dtype)
                w = _weight(len(counts), H, 2 * F, dtype, transposed)
                grad = torch.randn(T * k, F).to(dtype)
                x_d, w_d = _dev(x, device).requires_grad_(True), _dev(w, device).requires_grad_(True)
                out = fn(x_d, _dev(index.to(int_dtype), device), w_d, _dev(offsets.to(int_dtype), device))
                assert out.dtype == dtype, f"{where}: result is {out.dtype}"
                _backward(out, _dev(grad, device))
                call = lambda a, b, index=index, offsets=offsets: ref.moe_gate_up(a, index, b, offsets)  # noqa: E731
                want, (dx, dw) = _reference(call, [x, w], grad, False)
                mag, (mx, mw) = _reference(call, [x, w], grad, True)
                _bound_check(out, want, mag, dtype, f"{where}: forward")
                _bound_check(x_d.grad, dx, mx, dtype, f"{where}: d x")
                _bound_check(w_d.grad, dw, mw, dtype, f"{where}: d weight")


def check_moe_down_combine(fn, device: torch.device, dtype: torch.dtype) -> None:
    for counts, tail, T, k, H, F in MOE_CASES:
        for transposed, weighted in ((True, True), (False, True), (True, False)):
            where = (f"moe_down_combine {dtype} rows/expert {counts} tail {tail} tokens {T} k {k} H={H} F={F} "
                     f"{'transposed' if transposed else 'contiguous'} weight, "
                     f"{'weighted' if weighted else 'unweighted'}")
            index, offsets = _routing(counts, tail, T, k)
            h = torch.randn(T * k, F).to(dtype)
            w = _weight(len(counts), F, H, dtype, transposed)
            weights = torch.rand(T, k).add(0.1).to(dtype) if weighted else None
            grad = torch.randn(T, H).to(dtype)
            h_d, w_d = _dev(h, device).requires_grad_(True), _dev(w, device).requires_grad_(True)
            r_d = _dev(weights, device).requires_grad_(True) if weighted else None
            out = fn(h_d, w_d, _dev(offsets, device), _dev(index, device), r_d)
            assert out.dtype == dtype, f"{where}: result is {out.dtype}"
            _backward(out, _dev(grad, device))
            call = lambda a, b, c=None, o=offsets, i=index: ref.moe_down_combine(a, b, o, i, c)  # noqa: E731
            want, grads = _reference(call, [h, w, weights], grad, False)
            mag, mags = _reference(call, [h, w, weights], grad, True)
            _bound_check(out, want, mag, dtype, f"{where}: forward")
            _bound_check(h_d.grad, grads[0], mags[0], dtype, f"{where}: d h")
            _bound_check(w_d.grad, grads[1], mags[1], dtype, f"{where}: d weight")
            if weighted:
                _bound_check(r_d.grad, grads[2], mags[2], dtype, f"{where}: d weights")
