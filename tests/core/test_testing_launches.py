"""polyaccel.testing.launches: the aten ops that launch a kernel, and Triton's launches apart."""

from __future__ import annotations

import torch
from polyaccel.plugins.cuda.kernels import swiglu as ks
from polyaccel.testing.launches import Launches


def test_counts_kernels_not_views_and_triton_apart():
    a, b = torch.randn(6, 8), torch.randn(6, 8)
    with Launches() as count:
        c = (a + b).t().reshape(-1)  # add, a view, and a copy of the transposed rows
        torch.empty(3)  # an allocation with no fill launches nothing
        ks.swiglu_forward(a, b)
    assert count.ops == {"add": 1, "clone": 1}, count.ops
    assert count.total == 2 and c.shape == (48,)
    assert dict(count.triton) == {"_swiglu_fwd_kernel": 1}, "the interpreter's own tensor work is not counted"


def test_triton_is_unpatched_on_exit():
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    before = (interpreter.InterpretedFunction.run, jit.JITFunction.run)
    a = torch.randn(4, 4)
    with Launches() as count:
        ks.swiglu_forward(a, a)
    assert (interpreter.InterpretedFunction.run, jit.JITFunction.run) == before
    ks.swiglu_forward(a, a)
    assert sum(count.triton.values()) == 1 and count.total == 0


def test_counts_reads_back_to_the_host_apart():
    a = torch.randn(6)
    with Launches() as count:
        a.sum().item()  # _local_scalar_dense
        bool(a.max() > 0)  # _local_scalar_dense
        torch.nonzero(a > 0)  # the output size is read
        torch.repeat_interleave(torch.tensor([1, 2]))  # the repeats summed for the size
        torch.repeat_interleave(a, torch.tensor([1, 2, 0, 1, 1, 1]), output_size=6)  # size given: no read
        torch.repeat_interleave(a, 2)  # int repeats: no read
        torch.sort(a)
        torch.histc(a, bins=4, min=-1, max=1)  # a range given: no read
        torch.histc(a, bins=4)  # the range read from the values
    assert dict(count.syncs) == {"_local_scalar_dense": 2, "nonzero": 1, "repeat_interleave": 1, "histc": 1}
    assert count.ops["sort"] == 1 and count.ops["repeat_interleave"] == 2  # (int repeats: an expand and a copy)
