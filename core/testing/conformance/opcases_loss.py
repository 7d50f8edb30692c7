"""Conformance cases of the loss ops: ``linear_cross_entropy``, ``logprobs``, ``entropy``, ``kl``.

The builder under test runs on the device; the reference runs on float64 host copies. Bounds: a
logit computed in a 16-bit dtype is off by up to a unit of its last place, so the loss and the
gradients are judged against the magnitudes those errors can reach (:func:`linear_cross_entropy_bounds`),
not against the (possibly cancelled) results.
"""

from __future__ import annotations

import torch
from polyaccel.ops import reference as ref

from .opcases import _dev, op_tolerances

#: (N, H, V, fraction of rows ignored, keyword arguments). The Triton chunk kernel compiles once per block of
#: V (next power of two) on a GPU: the ragged V < 64 share one, 300 is the other
LCE_CASES = [
    (37, 8, 37, 0.25, {}),
    (16, 5, 35, 1.0, {}),  # every row ignored
    (16, 5, 35, 1.0, {"reduction": "sum"}),
    (0, 4, 5, 0.0, {}),
    (29, 6, 300, 0.1, {"z_loss": 1e-3, "bias": True}),
    (20, 8, 33, 0.0, {"reduction": "sum", "ignore_index": -1}),
    (25, 8, 40, 0.2, {"num_items": 40, "chunk_size": 4}),
]


def linear_cross_entropy_bounds(h64, w64, b64, labels, *, ignore_index=-100, reduction="mean", z_loss=0.0,
                                num_items=None, **_):
    """Magnitudes bounding the rounding errors of (loss, d hidden, d weight, d bias) (float64, host).

    A logit z off by e moves a row's loss by at most 2 e (1 + 2 z_loss |lse|) and the logit's gradient by
    p e-ish; with e <= ulp * max|z| per row, the terms below times a dtype's rtol bound every builder.
    """
    z = torch.nn.functional.linear(h64, w64, b64)
    valid = labels != ignore_index
    if reduction == "sum":
        denom = 1.0
    else:
        denom = float(num_items) if num_items is not None else max(int(valid.sum()), 1)
    lse = torch.logsumexp(z, -1) if z.shape[0] else torch.zeros(0, dtype=z.dtype)
    grow = 1.0 + 2.0 * z_loss * lse.abs()
    zmax = z.abs().amax(-1) if z.shape[0] else torch.zeros(0, dtype=z.dtype)
    scale = valid.double() / denom
    loss_mag = (scale * (2 * zmax + 1) * grow).sum()
    p = torch.softmax(z, -1) if z.shape[0] else z
    onehot = torch.zeros_like(z)
    rows = valid.nonzero().squeeze(1)
    onehot[rows, labels[rows]] = 1.0
    g = (scale * (1 + 2 * zmax)).unsqueeze(1) * (p * grow.unsqueeze(1) + onehot)
    return loss_mag, g @ w64.abs(), g.t() @ h64.abs(), g.sum(0)


def _within(got, want, mag, dtype, what):
    rtol, atol = op_tolerances(dtype)
    g = got.detach().to("cpu", torch.float64)
    assert g.shape == want.shape, f"{what}: shape {tuple(g.shape)}, expected {tuple(want.shape)}"
    if not g.numel():
        return
    err = (g - want).abs()
    bound = atol + rtol * mag
    bad = ~(err <= bound)
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {g.numel()} elements out of bounds; max error "
                                 f"{float(err.max()):.3e}, worst excess {float((err - bound).max()):.3e}")


def _labels(n: int, v: int, ignored: float, ignore_index: int) -> torch.Tensor:
    labels = torch.randint(0, v, (n,))
    labels[torch.rand(n) < ignored] = ignore_index
    if ignored >= 1.0:
        labels[:] = ignore_index
    return labels


def check_linear_cross_entropy(fn, device: torch.device, dtype: torch.dtype) -> None:
    for n, h, v, ignored, kw in LCE_CASES:
        kw = dict(kw)
        with_bias = kw.pop("bias", False)
        labels = _labels(n, v, ignored, kw.get("ignore_index", -100))
        hidden = torch.randn(n, h).to(dtype)
        weight = (torch.randn(v, h) / h ** 0.5).to(dtype)
        bias = torch.randn(v).to(dtype) if with_bias else None
        where = f"linear_cross_entropy {dtype} N={n} H={h} V={v} {kw}{' bias' * with_bias}"
        leaves = [_dev(t, device).requires_grad_(True) for t in (hidden, weight) + ((bias,) if with_bias else ())]
        loss = fn(leaves[0], leaves[1], _dev(labels, device), bias=leaves[2] if with_bias else None, **kw)
        want_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        assert loss.shape == () and loss.dtype == want_dtype, f"{where}: loss is {loss.dtype}{tuple(loss.shape)}"
        loss.backward()
        ref_leaves = [t.double().requires_grad_(True) for t in (hidden, weight) + ((bias,) if with_bias else ())]
        want = ref.linear_cross_entropy(ref_leaves[0], ref_leaves[1], labels,
                                        bias=ref_leaves[2] if with_bias else None, **kw)
        want.backward()
        mags = linear_cross_entropy_bounds(*(t.detach() for t in ref_leaves[:2]),
                                           ref_leaves[2].detach() if with_bias else None, labels, **kw)
        _within(loss, want.detach(), mags[0], dtype, f"{where}: loss")
        for name, mine, theirs, mag in zip(("d hidden", "d weight", "d bias"), leaves, ref_leaves, mags[1:],
                                           strict=False):  # no bias: two leaves
            assert mine.grad is not None, f"{where}: backward produced no gradient for {name[2:]}"
            assert mine.grad.dtype == dtype, f"{where}: {name} is {mine.grad.dtype}, expected {dtype}"
            _within(mine.grad, theirs.grad, mag, dtype, f"{where}: {name}")
        if ignored >= 1.0:
            assert float(loss.detach()) == 0.0 and not bool(leaves[0].grad.any()), f"{where}: all ignored must give 0"


#: logits shapes [..., V]: rows, none, a leading batch, one class, a row over one Triton block. The rows and
#: the leading batch share V (one compile on a GPU: a kernel compiles once per block size and per pattern of
#: its sizes, see ``benchmarks/conformance_compiles.py``)
LOGITS_SHAPES = [(5, 130), (0, 3), (2, 3, 130), (4, 1), (3, 1500)]


def _logits_check(op: str, fn, device, dtype, make_args, reference) -> None:
    for shape in LOGITS_SHAPES:
        inputs = [(torch.randn(shape) * 3).to(dtype) for _ in range(2 if op == "kl" else 1)]
        labels = torch.randint(0, shape[-1], shape[:-1])
        where = f"{op} {dtype} logits {shape}"
        mine = [_dev(t, device).requires_grad_(True) for t in inputs]
        out = fn(*make_args(mine, _dev(labels, device)))
        want_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        assert out.shape == shape[:-1] and out.dtype == want_dtype, f"{where}: got {out.dtype}{tuple(out.shape)}"
        grad = torch.randn(shape[:-1], dtype=want_dtype)
        out.backward(_dev(grad, device))
        theirs = [t.double().requires_grad_(True) for t in inputs]
        want = reference(*make_args(theirs, labels))
        want.backward(grad.double())
        # a logit off by e moves the result by <= 2 e per input (16-bit logits are exact in float64, so only
        # the op's fp32 math errs here): bounded relative to the rows' largest logits
        zmax = sum(t.detach().abs().amax(-1) for t in theirs) + 1
        _within(out, want.detach(), zmax, dtype, f"{where}: forward")
        gmag = grad.double().abs().unsqueeze(-1) * zmax.unsqueeze(-1)
        for i, (m, t) in enumerate(zip(mine, theirs, strict=True)):
            assert m.grad is not None and m.grad.dtype == dtype, f"{where}: input {i} gradient missing or not {dtype}"
            _within(m.grad, t.grad, gmag.expand_as(t.grad), dtype, f"{where}: gradient of input {i}")


def check_logprobs(fn, device: torch.device, dtype: torch.dtype) -> None:
    _logits_check("logprobs", fn, device, dtype, lambda ts, labels: (ts[0], labels), ref.logprobs)


def check_entropy(fn, device: torch.device, dtype: torch.dtype) -> None:
    _logits_check("entropy", fn, device, dtype, lambda ts, labels: (ts[0],), ref.entropy)


def check_kl(fn, device: torch.device, dtype: torch.dtype) -> None:
    _logits_check("kl", fn, device, dtype, lambda ts, labels: (ts[0], ts[1]), ref.kl)


CHECKS = {
    "linear_cross_entropy": check_linear_cross_entropy,
    "logprobs": check_logprobs,
    "entropy": check_entropy,
    "kl": check_kl,
}
