"""The Triton gather_sum kernels under the interpreter: the op's conformance check on CPU tensors, and a
row longer than one block of columns in float64 against the reference."""

from __future__ import annotations

import pytest
import torch
from polyaccel.ops import reference as ref
from polyaccel.plugins.cuda.kernels import gather_sum as ks
from polyaccel.testing.conformance import opcases


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_conformance_check_passes_on_cpu_tensors(dtype):
    opcases.check_gather_sum(ks.gather_sum, torch.device("cpu"), dtype)


def test_float64_exact_across_blocks_with_int32_index():
    T, k, H = 5, 2, 2 * ks.MAX_BLOCK_H + 3
    rows = torch.randn(T * k, H, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, k, dtype=torch.float64, requires_grad=True)
    index = torch.randperm(T * k).view(T, k).to(torch.int32)
    go = torch.randn(T, H, dtype=torch.float64)
    got = ks.gather_sum(rows, index, w)
    want = ref.gather_sum(rows, index, w)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    for a, b in zip(torch.autograd.grad(got, (rows, w), go), torch.autograd.grad(want, (rows, w), go), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_weight_gradient_when_rows_need_none_and_bad_shapes():
    rows, index = torch.randn(6, 3), torch.randperm(6).view(3, 2)
    w = torch.rand(3, 2, requires_grad=True)
    ks.gather_sum(rows, index, w).sum().backward()
    # d w[t, j] = dot(rows[index[t, j]], ones) = the sum of that row
    torch.testing.assert_close(w.grad.double(), rows.double()[index].sum(-1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="tokens \\* k == rows"):
        ks.gather_sum(rows, index[:2])


def test_block_is_triton_next_power_of_2_capped():
    import triton

    for h in [0, *range(1, 300), 1023, 1024, 1025, 2**31 + 1]:
        assert ks._block(h) == min(ks.MAX_BLOCK_H, triton.next_power_of_2(max(h, 1))), h
