"""Reference ops against independent float64 computations."""

import math

import pytest
import torch
from polyaccel.ops import reference as ref


def rand_lists(shapes, dtype=torch.float64, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]


SHAPES = [(3, 5), (0,), (7,), (2, 3, 4), (1,)]


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_fused_adam_reference_matches_textbook_float64(adam_w_mode, bias_correction):
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.05
    p = rand_lists(SHAPES)
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    ep, em, ev = [x.clone() for x in p], [x.clone() for x in m], [x.clone() for x in v]
    for step in range(1, 6):
        g = [torch.randn_like(x) for x in p]
        ref.fused_adam(p, g, m, v, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step,
                       adam_w_mode=adam_w_mode, bias_correction=bias_correction)
        for i, gi in enumerate(g):  # textbook Adam(W), elementwise in float64
            gi = gi + wd * ep[i] if not adam_w_mode else gi
            em[i] = b1 * em[i] + (1 - b1) * gi
            ev[i] = b2 * ev[i] + (1 - b2) * gi**2
            mh = em[i] / (1 - b1**step) if bias_correction else em[i]
            vh = ev[i] / (1 - b2**step) if bias_correction else ev[i]
            decayed = ep[i] * (1 - lr * wd) if adam_w_mode else ep[i]
            ep[i] = decayed - lr * mh / (vh.sqrt() + eps)
    for a, b in zip(p, ep, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_fused_lion_reference_matches_float64():
    lr, b1, b2, wd = 1e-3, 0.9, 0.99, 0.1
    p = rand_lists(SHAPES)
    m = [torch.randn_like(x) for x in p]
    ep, em = [x.clone() for x in p], [x.clone() for x in m]
    for _ in range(4):
        g = [torch.randn_like(x) for x in p]
        ref.fused_lion(p, g, m, lr=lr, beta1=b1, beta2=b2, weight_decay=wd)
        for i, gi in enumerate(g):
            c = torch.lerp(em[i], gi, 1 - b1)
            ep[i] = ep[i] - lr * (torch.sign(c) + wd * ep[i])
            em[i] = torch.lerp(em[i], gi, 1 - b2)
    for a, b in zip(p + m, ep + em, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_fused_lamb_reference_matches_float64():
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-6, 0.01
    p = rand_lists(SHAPES)
    p.append(torch.zeros(4, dtype=torch.float64))  # zero weight norm -> trust ratio 1
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    ep, em, ev = [x.clone() for x in p], [x.clone() for x in m], [x.clone() for x in v]
    for step in range(1, 4):
        g = [torch.randn_like(x) for x in p]
        ref.fused_lamb(p, g, m, v, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step)
        for i, gi in enumerate(g):
            em[i] = b1 * em[i] + (1 - b1) * gi
            ev[i] = b2 * ev[i] + (1 - b2) * gi * gi
            u = (em[i] / (1 - b1**step)) / ((ev[i] / (1 - b2**step)).sqrt() + eps) + wd * ep[i]
            wn, un = math.sqrt(float((ep[i] ** 2).sum())), math.sqrt(float((u**2).sum()))
            trust = min(max(wn / un, 0.01), 10.0) if wn > 0 and un > 0 else 1.0
            ep[i] = ep[i] - lr * trust * u
    for a, b in zip(p, ep, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_swiglu_forward_and_backward_match_autograd_float64():
    gate = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    up = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    out = ref.swiglu(gate, up)
    g2, u2 = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    expect = torch.nn.functional.silu(g2) * u2
    torch.testing.assert_close(out, expect, rtol=1e-14, atol=1e-14)
    go = torch.randn_like(out)
    out.backward(go)
    expect.backward(go)
    torch.testing.assert_close(gate.grad, g2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(up.grad, u2.grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(ref.swiglu, (gate.detach().requires_grad_(), up.detach().requires_grad_()))


def test_bad_op_arguments_raise_polyaccels_op_argument_error_which_is_a_value_error_too():
    import polyaccel

    with pytest.raises(polyaccel.OpArgumentError) as info:
        ref.swiglu(torch.randn(3), torch.randn(4))
    for base in (polyaccel.OpError, polyaccel.InvalidArgument, polyaccel.PolyaccelError, ValueError):
        assert isinstance(info.value, base), base


def test_swiglu_bad_inputs():
    with pytest.raises(ValueError, match="differ in shape"):
        ref.swiglu(torch.randn(3), torch.randn(4))
    with pytest.raises(ValueError, match="same dtype"):
        ref.swiglu(torch.randn(3), torch.randn(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="floating-point"):
        ref.swiglu(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32))


def test_grouped_mm_matches_per_expert_float64_with_empty_experts():
    E, K, N = 4, 6, 5
    counts = [3, 0, 4, 2]
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    x = torch.randn(sum(counts) + 1, K, dtype=torch.float64, requires_grad=True)  # one unrouted row
    w = torch.randn(E, K, N, dtype=torch.float64, requires_grad=True)
    out = ref.grouped_mm(x, w, offsets)
    rows, start = [], 0
    for e, c in enumerate(counts):
        for r in range(start, start + c):
            rows.append(x[r] @ w[e])
        start += c
    rows.append(torch.zeros(N, dtype=torch.float64))
    torch.testing.assert_close(out, torch.stack(rows), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(ref.grouped_mm, (x, w, offsets))


def test_grouped_mm_bad_inputs():
    x, w = torch.randn(4, 3), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="one entry per expert"):
        ref.grouped_mm(x, w, torch.tensor([4]))
    with pytest.raises(ValueError, match="non-decreasing"):
        ref.grouped_mm(x, w, torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="exceeds"):
        ref.grouped_mm(x, w, torch.tensor([2, 9]))
    with pytest.raises(ValueError, match="int32 or int64"):
        ref.grouped_mm(x, w, torch.tensor([2.0, 4.0]))
    with pytest.raises(ValueError, match="features"):
        ref.grouped_mm(torch.randn(4, 2), w, torch.tensor([2, 4]))


def test_gather_sum_matches_per_token_loops_float64():
    T, k, H = 6, 3, 5
    rows = torch.randn(T * k, H, dtype=torch.float64, requires_grad=True)
    index = torch.randperm(T * k).view(T, k)
    w = torch.rand(T, k, dtype=torch.float64, requires_grad=True)
    out = ref.gather_sum(rows, index, w)
    expect = torch.stack([sum(w[t, j] * rows[index[t, j]] for j in range(k)) for t in range(T)])
    torch.testing.assert_close(out, expect, rtol=1e-14, atol=1e-14)
    plain = torch.stack([sum(rows[index[t, j]] for j in range(k)) for t in range(T)])
    torch.testing.assert_close(ref.gather_sum(rows, index), plain, rtol=1e-14, atol=1e-14)
    go = torch.randn(T, H, dtype=torch.float64)
    got = torch.autograd.grad(out, (rows, w), go)
    want = torch.autograd.grad(expect, (rows, w), go)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(ref.gather_sum, (rows, index, w))
    assert torch.autograd.gradcheck(lambda r: ref.gather_sum(r, index), (rows,))


def test_gather_sum_bad_inputs():
    rows, index = torch.randn(6, 4), torch.arange(6).view(3, 2)
    with pytest.raises(ValueError, match="tokens \\* k == rows"):
        ref.gather_sum(rows, index[:2])
    with pytest.raises(ValueError, match="int32/int64"):
        ref.gather_sum(rows, index.float())
    with pytest.raises(ValueError, match="shaped like index"):
        ref.gather_sum(rows, index, torch.rand(2, 3))
    with pytest.raises(ValueError, match="exactly once"):
        ref.gather_sum(rows, torch.tensor([[0, 1], [1, 2], [3, 4]]))
    with pytest.raises(ValueError, match="exactly once"):
        ref.gather_sum(rows, torch.tensor([[0, 1], [2, 3], [4, 6]]))
    with pytest.raises(ValueError, match="2-D floating-point"):
        ref.gather_sum(rows.long(), index)
