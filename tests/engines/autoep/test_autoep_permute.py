"""AutoEP's row permutations and its combine (``ops.gather_sum``): values and float64 gradients against plain
index_select autograd."""

from __future__ import annotations

import pytest
import torch
from polyaccel import ops
from polyaccel.engines.autoep.permute import DispatchRows, PermuteRows, inverse_permutation


def _routing(T: int, k: int, E: int, gen: torch.Generator):
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    order = torch.argsort(idx.reshape(-1), stable=True)
    return order, inverse_permutation(order)


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g, retain_graph=True)


def test_inverse_permutation():
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    inv = inverse_permutation(perm)
    assert torch.equal(perm[inv], torch.arange(50)) and torch.equal(inv[perm], torch.arange(50))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_dispatch_and_combine_match_index_select_autograd(k):
    gen = torch.Generator().manual_seed(k)
    T, H, E = 13, 6, 7
    order, inverse = _routing(T, k, E, gen)
    x = torch.randn(T, H, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(T, k, dtype=torch.float64, generator=gen, requires_grad=True)
    scale = torch.randn(T * k, H, dtype=torch.float64, generator=gen)  # stands in for the experts
    g = torch.randn(T, H, dtype=torch.float64, generator=gen)

    got = ops.gather_sum(DispatchRows.apply(x, order, inverse, k) * scale, inverse.view(T, k), w)
    routed = x.index_select(0, order // k) * scale
    want = (routed * w.reshape(-1)[order].unsqueeze(-1)).index_select(0, inverse).view(T, k, H).sum(1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(_grads(got, (x, w), g), _grads(want, (x, w), g), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)

    plain = ops.gather_sum(DispatchRows.apply(x, order, inverse, k) * scale, inverse.view(T, k))
    want_plain = routed.index_select(0, inverse).view(T, k, H).sum(1)
    torch.testing.assert_close(plain, want_plain, rtol=0, atol=1e-12)
    torch.testing.assert_close(_grads(plain, x, g)[0], _grads(want_plain, x, g)[0], rtol=0, atol=1e-12)


def test_permute_rows_and_gradcheck():
    gen = torch.Generator().manual_seed(3)
    perm = torch.randperm(9, generator=gen)
    x = torch.randn(9, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.equal(PermuteRows.apply(x, perm, inverse_permutation(perm)), x[perm])
    assert torch.autograd.gradcheck(lambda t: PermuteRows.apply(t, perm, inverse_permutation(perm)), (x,))
    order, inverse = _routing(5, 2, 4, gen)
    xs = torch.randn(5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    ws = torch.rand(5, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: ops.gather_sum(DispatchRows.apply(a, order, inverse, 2) ** 2, inverse.view(5, 2), b), (xs, ws))


@pytest.mark.parametrize("builder", ["reference", "triton"])
def test_gate_up_halves_hands_back_the_gradient_with_or_without_a_copy(builder):
    from polyaccel.engines.autoep.moe import GateUpHalves
    from polyaccel.ops import reference as ref

    if builder == "triton":
        from polyaccel.plugins.cuda.kernels.swiglu import swiglu  # writes the halves of one tensor
    else:
        swiglu = ref.swiglu  # two tensors of its own: the backward concatenates
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(6, 10, dtype=torch.float64, generator=gen, requires_grad=True)
    go = torch.randn(6, 5, dtype=torch.float64, generator=gen)
    gate, up = GateUpHalves.apply(h)
    (got,) = torch.autograd.grad(swiglu(gate, up), h, go)
    a, b = h.chunk(2, dim=-1)
    (want,) = torch.autograd.grad(torch.nn.functional.silu(a) * b, h, go)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 if builder == "triton" else 1e-12)
    # one half unused: its gradient is zero
    (only_gate,) = torch.autograd.grad(GateUpHalves.apply(h)[0], h, go)
    assert torch.equal(only_gate[:, :5], go) and not only_gate[:, 5:].any()
