"""linear_cross_entropy, logprobs, entropy, kl: the chunked builder and the references against float64 math,
the chunking's memory bound, the contract's refusals and Hugging Face's causal-LM loss."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from polyaccel import ops
from polyaccel.errors import OpArgumentError, Unsupported
from polyaccel.ops import calls_loss, chunked_loss
from polyaccel.ops import reference as ref
from polyaccel.testing.conformance import opcases_loss
from torch.utils._python_dispatch import TorchDispatchMode


def _inputs(n, h, v, dtype, *, ignored=0.25, seed=0, bias=False, ignore_index=-100):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) / h ** 0.5
    b = torch.randn(v, generator=gen, dtype=torch.float64) if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignored] = ignore_index
    return [t if t is None else t.to(dtype) for t in (hidden, weight, b)], labels


def _run(fn, tensors, labels, **kw):
    leaves = [t.clone().requires_grad_(True) for t in tensors if t is not None]
    loss = fn(leaves[0], leaves[1], labels, bias=leaves[2] if len(leaves) > 2 else None, **kw)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


def _closed_form(hidden, weight, bias, labels, ignore_index=-100, z_loss=0.0, reduction="mean", num_items=None,
                 chunk_size=None):
    """Independent float64 math: torch's cross_entropy on the logits, the z-loss added by hand."""
    z = F.linear(hidden, weight, bias)
    valid = labels != ignore_index
    ce = F.cross_entropy(z, labels, ignore_index=ignore_index, reduction="sum")
    lse = torch.logsumexp(z, -1)
    total = ce + z_loss * (lse[valid] ** 2).sum()
    if reduction == "sum":
        return total
    return total / (num_items if num_items is not None else max(int(valid.sum()), 1))


CASES = [
    {},
    {"z_loss": 1e-2},
    {"reduction": "sum"},
    {"num_items": 50},
    {"num_items": torch.tensor(50)},
    {"chunk_size": 3, "bias": True},
    {"ignore_index": -1, "z_loss": 1e-3},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_builder_matches_float64_math(dtype):
    assert "chunked" in ops.explain("linear_cross_entropy", "cpu").split("->")[1].split()[0]
    for i, case in enumerate(CASES):
        kw = dict(case)
        with_bias = kw.pop("bias", False)
        tensors, labels = _inputs(41, 12, 37, dtype, seed=i, bias=with_bias, ignore_index=kw.get("ignore_index", -100))
        loss, grads = _run(ops.linear_cross_entropy, tensors, labels, **kw)
        t64 = [None if t is None else t.double() for t in tensors]
        want, want_grads = _run(lambda h, w, y, bias=None, **k: _closed_form(h, w, bias, y, **k), t64, labels, **kw)
        assert loss.dtype == torch.float32 and all(g.dtype == dtype for g in grads)
        mags = opcases_loss.linear_cross_entropy_bounds(*t64, labels, **kw)
        rtol, atol = opcases_loss.op_tolerances(dtype)
        for got, exp, mag, what in zip([loss, *grads], [want, *want_grads], mags, ["loss", "dh", "dw", "db"],
                                       strict=False):
            err = (got.double() - exp).abs()
            assert bool((err <= atol + rtol * mag).all()), f"{case} {what}: max error {float(err.max()):.3e}"
        if dtype == torch.float32:  # fp32 is tight: a wrong scale or a missed term shows far above 1e-5
            torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grads[0].double(), want_grads[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_gives_zero_loss_and_zero_gradients(reduction):
    (h, w, _), labels = _inputs(9, 4, 7, torch.float32, ignored=1.0)
    for fn in (ops.linear_cross_entropy, ref.linear_cross_entropy):
        loss, (dh, dw) = _run(fn, [h, w], labels, reduction=reduction)
        assert float(loss) == 0.0 and not dh.any() and not dw.any()
        assert not (loss.isnan() or dh.isnan().any() or dw.isnan().any())


def test_the_reference_is_torch_cross_entropy_in_float64():
    tensors, labels = _inputs(30, 6, 11, torch.float64, bias=True)
    for kw in ({}, {"z_loss": 0.1}, {"reduction": "sum"}, {"num_items": 13}):
        got, g_grads = _run(ref.linear_cross_entropy, tensors, labels, **kw)
        want, w_grads = _run(lambda h, w, y, bias=None, **k: _closed_form(h, w, bias, y, **k), tensors, labels, **kw)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(g_grads, w_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


class _LargestTensor(TorchDispatchMode):
    """The most elements any op's output had while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunking_never_allocates_the_whole_logits():
    n, h, v = 4096, 8, 512
    (hidden, weight, _), labels = _inputs(n, h, v, torch.float32)
    chunk = chunked_loss.default_chunk_size(n, h, v)
    assert chunk == chunked_loss.MIN_CHUNK < n  # the rule: N / ceil(V / H) = 64, raised to MIN_CHUNK
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with _LargestTensor() as probe:
        loss = ops.linear_cross_entropy(hidden, weight, labels)
        loss.backward()
    assert probe.largest <= chunk * v, f"an intermediate of {probe.largest} elements (N x V = {n * v})"
    with _LargestTensor() as probe_ref:  # the probe sees the reference's [N, V] logits
        ref.linear_cross_entropy(hidden, weight, labels).backward()
    assert probe_ref.largest >= n * v
    with _LargestTensor() as probe_small:
        ops.linear_cross_entropy(hidden, weight, labels, chunk_size=100).backward()
    assert probe_small.largest <= max(100 * v, v * h)
    assert chunked_loss.default_chunk_size(32768, 4096, 128256) == 1024  # Llama-3-8B: 32 chunks


class _LiveLogits(TorchDispatchMode):
    """The most GEMM results of at least ``big`` elements (the chunks' logits) alive at one time."""

    def __init__(self, big: int):
        super().__init__()
        self.big, self.alive, self.most = big, 0, 0

    def _gone(self):
        self.alive -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out._base is None \
                and out.numel() >= self.big:
            self.alive += 1
            self.most = max(self.most, self.alive)
            weakref.finalize(out, self._gone)
        return out


def test_one_chunk_of_logits_is_alive_at_a_time():
    (h, w, _), labels = _inputs(512, 8, 256, torch.bfloat16)
    h.requires_grad_(True)
    with _LiveLogits(128 * 256) as probe:
        ops.linear_cross_entropy(h, w.requires_grad_(True), labels, chunk_size=128).backward()
    assert probe.most == 1  # the next chunk's logits are computed after the last one's are freed


def test_no_grad_and_frozen_head_and_second_backward():
    (h, w, _), labels = _inputs(20, 5, 9, torch.float32)
    with torch.no_grad():
        plain = ops.linear_cross_entropy(h.requires_grad_(True), w, labels)
    assert plain.grad_fn is None
    loss = ops.linear_cross_entropy(h, w, labels)  # weight frozen: only hidden gets a gradient
    torch.testing.assert_close(loss.detach(), plain)
    loss.backward(retain_graph=True)
    assert h.grad is not None and w.grad is None
    with pytest.raises(Unsupported, match="second backward"):
        loss.backward()
    h2 = h.detach().requires_grad_(True)
    (ops.linear_cross_entropy(h2, w, labels) * 3.0).backward()  # the backward scales the forward's gradients
    torch.testing.assert_close(h2.grad, 3.0 * h.grad)


def test_under_autocast_the_head_runs_in_the_autocast_dtype():
    (h, w, _), labels = _inputs(40, 8, 50, torch.float32)
    got = [t.clone().requires_grad_(True) for t in (h, w)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ops.linear_cross_entropy(got[0], got[1], labels)
    loss.backward()
    want = [t.clone().requires_grad_(True) for t in (h, w)]
    ref.linear_cross_entropy(want[0].bfloat16(), want[1].bfloat16(), labels).backward()
    assert loss.dtype == torch.float32 and got[0].grad.dtype == torch.float32
    with torch.no_grad():
        want_loss = ref.linear_cross_entropy(h.bfloat16(), w.bfloat16(), labels)
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-3, atol=1e-3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-3)


def test_hugging_face_causal_lm_loss_path_is_matched():
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(3)
    b, s, hdim, v = 2, 9, 8, 31
    hidden = torch.randn(b, s, hdim, generator=gen, requires_grad=True)
    head = torch.nn.Linear(hdim, v, bias=False)
    labels = torch.randint(0, v, (b, s), generator=gen)
    labels[0, :3] = -100
    for num_items in (None, torch.tensor(11)):
        hidden.grad = head.weight.grad = None
        want = ForCausalLMLoss(head(hidden), labels, v, num_items_in_batch=num_items)
        want.backward()
        want_grads = (hidden.grad.clone(), head.weight.grad.clone())
        hidden.grad = head.weight.grad = None
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        got = ops.linear_cross_entropy(hidden.reshape(-1, hdim), head.weight, shifted.reshape(-1),
                                       num_items=num_items)
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(hidden.grad, want_grads[0], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(head.weight.grad, want_grads[1], rtol=1e-4, atol=1e-6)


def test_logits_ops_match_torch_closed_forms():
    gen = torch.Generator().manual_seed(5)
    zp = (torch.randn(3, 4, 50, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    zq = (torch.randn(3, 4, 50, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    labels = torch.randint(0, 50, (3, 4), generator=gen)
    go = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    closed = {
        "logprobs": (lambda p, q: F.log_softmax(p, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1),
                     lambda p, q: ops.logprobs(p, labels)),
        "entropy": (lambda p, q: torch.distributions.Categorical(logits=p).entropy(), lambda p, q: ops.entropy(p)),
        "kl": (lambda p, q: F.kl_div(F.log_softmax(q, -1), F.log_softmax(p, -1), log_target=True,
                                      reduction="none").sum(-1), lambda p, q: ops.kl(p, q)),
    }
    for op, (want_fn, got_fn) in closed.items():
        grads = []
        for fn in (want_fn, got_fn):
            zp.grad = zq.grad = None
            out = fn(zp, zq)
            out.backward(go)
            grads.append((out.detach(), zp.grad.clone(), None if zq.grad is None else zq.grad.clone()))
        (w, wp, wq), (g, gp, gq) = grads
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=op)
        torch.testing.assert_close(gp, wp, rtol=1e-10, atol=1e-12, msg=op)
        if op == "kl":
            torch.testing.assert_close(gq, wq, rtol=1e-10, atol=1e-12)
        bf = got_fn(zp.detach().bfloat16(), zq.detach().bfloat16())
        assert bf.dtype == torch.float32


def test_conformance_checks_catch_a_wrong_builder():
    bad = lambda *a, **k: ref.linear_cross_entropy(*a, **k) * 1.01  # noqa: E731
    with pytest.raises(AssertionError, match="loss"):
        opcases_loss.check_linear_cross_entropy(bad, torch.device("cpu"), torch.float32)
    with pytest.raises(AssertionError, match="forward"):
        opcases_loss.check_entropy(lambda z: ref.entropy(z) + 1e-3, torch.device("cpu"), torch.float32)


def _refusal(fn, match):
    with pytest.raises(OpArgumentError, match=match):
        fn()


def test_the_contract_refuses_before_any_builder(monkeypatch):
    def no_builder(*a, **k):
        raise AssertionError("a builder was resolved for a call the contract refuses")

    monkeypatch.setattr(calls_loss._RUNTIME.ops, "resolve", no_builder)
    (h, w, b), labels = _inputs(6, 4, 5, torch.float32, bias=True)
    lce = ops.linear_cross_entropy
    bad_labels = labels.clone()
    bad_labels[2] = 5
    cases = [
        (lambda: lce(h, w, bad_labels), r"labels\[2\] = 5"),
        (lambda: lce(h, w, torch.full((6,), -7)), r"labels\[0\] = -7"),
        (lambda: lce(h, w, labels.int()), "int64"),
        (lambda: lce(h, w, labels[:5]), "one label per row"),
        (lambda: lce(h.reshape(2, 3, 4), w, labels), "2-D"),
        (lambda: lce(h, w[:, :3], labels), r"\[V_local, H\]"),
        (lambda: lce(h, w.double(), labels), "one dtype"),
        (lambda: lce(h.int(), w.int(), labels), "dtype"),
        (lambda: lce(h, w, labels, bias=b[:4]), "bias"),
        (lambda: lce(h, w, labels, z_loss=float("nan")), "z_loss"),
        (lambda: lce(h, w, labels, z_loss=-0.1), "z_loss"),
        (lambda: lce(h, w, labels, reduction="none"), "reduction"),
        (lambda: lce(h, w, labels, num_items=0), "num_items"),
        (lambda: lce(h, w, labels, num_items=torch.tensor(-2.0)), "num_items"),
        (lambda: lce(h, w, labels, num_items=4, reduction="sum"), "num_items"),
        (lambda: lce(h, w, labels, chunk_size=0), "chunk_size"),
        (lambda: lce(h, w, labels, chunk_size=2.5), "chunk_size"),
        (lambda: lce(h, w, labels, vocab_start=3), "group"),
        (lambda: lce(h, w, labels, ignore_index=1.5), "ignore_index"),
        (lambda: lce(h, w[:0], labels), "V_local = 0"),
        (lambda: ops.logprobs(h, torch.full((6,), 4)), r"labels\[0\] = 4"),
        (lambda: ops.logprobs(h, labels.clamp(min=0)[:3]), "one label per row"),
        (lambda: ops.entropy(h.int()), "dtype"),
        (lambda: ops.kl(h, h.double()), "one shape and dtype"),
        (lambda: ops.kl(h, h[:3]), "one shape and dtype"),
        (lambda: ops.entropy(h[:, :0]), "V_local >= 1"),
    ]
    for call, match in cases:
        _refusal(call, match)
