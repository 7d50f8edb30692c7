"""The fused expert ops' references (moe_gate_up, moe_down_combine) and their entry points."""

from __future__ import annotations

import re

import pytest
import torch
from polyaccel import ops
from polyaccel.errors import OpArgumentError
from polyaccel.ops import reference as ref


def _routing(T=5, k=2, E=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    expert = torch.randint(0, E, (T, k), generator=g)  # token t's slot j goes to expert[t, j]
    flat = expert.reshape(-1)
    order = torch.argsort(flat, stable=True)
    index = torch.empty_like(order)
    index[order] = torch.arange(order.numel())
    offsets = torch.bincount(flat, minlength=E).cumsum(0)
    return expert, index.view(T, k), offsets, g


def test_the_references_are_the_per_token_expert_mlp():
    T, k, E, H, F = 5, 2, 3, 6, 4
    expert, index, offsets, g = _routing(T, k, E)
    x = torch.randn(T, H, dtype=torch.float64, generator=g)
    w1 = torch.randn(E, H, 2 * F, dtype=torch.float64, generator=g)
    w2 = torch.randn(E, F, H, dtype=torch.float64, generator=g)
    weights = torch.rand(T, k, dtype=torch.float64, generator=g)
    h = ref.moe_gate_up(x, index, w1, offsets)
    out = ref.moe_down_combine(h, w2, offsets, index, weights)
    for t in range(T):
        want = torch.zeros(H, dtype=torch.float64)
        for j in range(k):
            e = int(expert[t, j])
            gu = x[t] @ w1[e]
            hid = torch.nn.functional.silu(gu[:F]) * gu[F:]
            torch.testing.assert_close(h[index[t, j]], hid, rtol=1e-12, atol=1e-12)
            want += weights[t, j] * (hid @ w2[e])
        torch.testing.assert_close(out[t], want, rtol=1e-12, atol=1e-12)


def test_gradients_match_finite_differences():
    T, k, E, H, F = 3, 2, 2, 4, 3
    _, index, offsets, g = _routing(T, k, E, seed=3)
    x = torch.randn(T, H, dtype=torch.float64, generator=g, requires_grad=True)
    w1 = torch.randn(E, H, 2 * F, dtype=torch.float64, generator=g, requires_grad=True)
    w2 = torch.randn(E, F, H, dtype=torch.float64, generator=g, requires_grad=True)
    weights = torch.rand(T, k, dtype=torch.float64, generator=g, requires_grad=True)
    chain = lambda a, b, c, d: ref.moe_down_combine(ref.moe_gate_up(a, index, b, offsets), c, offsets, index, d)
    assert torch.autograd.gradcheck(chain, (x, w1, w2, weights))


def test_entry_points_run_the_reference_on_the_host_and_provide_nothing_fused():
    _, index, offsets, g = _routing()
    x = torch.randn(5, 6, generator=g)
    w1, w2 = torch.randn(3, 6, 8, generator=g), torch.randn(3, 4, 6, generator=g)
    assert torch.equal(ops.moe_gate_up(x, index, w1, offsets), ref.moe_gate_up(x, index, w1, offsets))
    h = torch.randn(10, 4, generator=g)
    assert torch.equal(ops.moe_down_combine(h, w2, offsets, index), ref.moe_down_combine(h, w2, offsets, index))
    assert not ops.provides("moe_gate_up", "cpu") and not ops.provides("moe_down_combine", "cpu")


@pytest.mark.parametrize("call,words", [
    (lambda x, i, w, o: ops.moe_gate_up(x, i.view(-1), w, o), "index must be an int32/int64 [tokens, k]"),
    (lambda x, i, w, o: ops.moe_gate_up(x, i, w[:, :, :7], o), "must be even"),
    (lambda x, i, w, o: ops.moe_gate_up(x, i, w[:, :5], o), "features"),
    (lambda x, i, w, o: ops.moe_gate_up(x, i, w, o[:2]), "one entry per expert"),
    (lambda x, i, w, o: ops.moe_gate_up(x, torch.zeros_like(i), w, o), "exactly once"),
    (lambda x, i, w, o: ops.moe_gate_up(x, i, w, o + 1), "exceeds"),
    (lambda x, i, w, o: ops.moe_down_combine(x, w, o, i), "tokens * k == rows"),
    (lambda x, i, w, o: ops.moe_down_combine(torch.randn(10, 5), w, o, i), "x has 5 features but weight expects 6"),
    (lambda x, i, w, o: ops.moe_down_combine(torch.randn(10, 6), w, o, i, torch.rand(5, 3)), "shaped like index"),
])
def test_bad_calls_name_the_argument(call, words):
    _, index, offsets, g = _routing()
    x = torch.randn(5, 6, generator=g)
    w = torch.randn(3, 6, 8, generator=g)
    before = [t.clone() for t in (x, index, w, offsets)]
    with pytest.raises(OpArgumentError, match=re.escape(words)):
        call(x, index, w, offsets)
    for t, b in zip((x, index, w, offsets), before, strict=True):
        assert torch.equal(t, b), "inputs untouched"
