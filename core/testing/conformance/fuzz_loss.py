"""The op fuzz suite's strategies and runners for ``linear_cross_entropy``, ``logprobs``, ``entropy``, ``kl``.

Drawn: strided and offset layouts of every input, zero rows, one class, ignored labels (all of
them too), a bias or none, z-loss, both reductions, ``num_items``, chunk sizes down to one row;
now and then a call the contract says must be refused (a label outside the vocabulary, a NaN or
negative z-loss, an unknown reduction, ``num_items`` <= 0, ``chunk_size`` <= 0, labels of another
dtype), for which only an honest refusal passes. Values are finite (the ops define no NaN
propagation beyond the reference's arithmetic). The reference runs on float64 copies; the
bounds are :mod:`.opcases_loss`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import polyaccel.ops as ops
import torch
from hypothesis import strategies as st
from polyaccel.ops import reference as ref

from .fuzz_layouts import Buffers, Layout, TensorSpec, draw_layout, host64
from .fuzz_outcome import COMPARED, REFUSED, attempt, close, fail, pretty_repr, unchanged
from .opcases_loss import linear_cross_entropy_bounds

SEEDS = st.integers(0, 2**31 - 1)
_KINDS = st.sampled_from(("valid",) * 14 + ("bad label", "bad z_loss", "bad reduction", "bad num_items",
                                            "bad chunk_size", "int32 labels"))
_BAD = {"z_loss": (math.nan, -1e-3, math.inf), "reduction": ("none", "MEAN"), "num_items": (0, -3),
        "chunk_size": (0, -1)}


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ===================================================================== linear_cross_entropy
@dataclass(frozen=True)
class LinearCrossEntropyCase:
    hidden: TensorSpec
    weight: TensorSpec
    bias: TensorSpec | None
    ignored: float  # the fraction of labels set to ignore_index
    kwargs: tuple  # (name, value) pairs of the keyword arguments
    refuse: str
    seed: int

    def __repr__(self) -> str:
        b = repr(self.bias) if self.bias is not None else "bias: None"
        kw = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
        why = f" | must refuse: {self.refuse}" if self.refuse else ""
        return (f"linear_cross_entropy | {self.hidden!r} | {self.weight!r} | {b} | ignored {self.ignored:g} | "
                f"{kw}{why} | seed {self.seed}")

    _repr_pretty_ = pretty_repr


@st.composite
def linear_cross_entropy_cases(draw, dtypes: tuple[torch.dtype, ...]) -> LinearCrossEntropyCase:
    dtype = draw(st.sampled_from(dtypes))
    n, h, v = draw(st.integers(0, 9)), draw(st.integers(1, 6)), draw(st.integers(1, 9))
    bias = TensorSpec("bias", draw_layout(draw, (v,)), dtype) if draw(st.booleans()) else None
    kw = {"ignore_index": draw(st.sampled_from((-100, -1))), "reduction": draw(st.sampled_from(("mean", "sum"))),
          "z_loss": draw(st.sampled_from((0.0, 0.0, 1e-3, 0.1)))}
    if kw["reduction"] == "mean" and draw(st.booleans()):
        kw["num_items"] = draw(st.sampled_from((1, 7, 100)))
    chunk = draw(st.sampled_from((None, None, 1, 2, 5)))
    if chunk is not None:
        kw["chunk_size"] = chunk
    kind = draw(_KINDS)
    refuse = ""
    if kind == "bad label":
        refuse = "a label outside [0, V) that is not ignore_index"
        n = max(n, 1)
    elif kind == "int32 labels":
        refuse = "int32 labels"
    elif kind != "valid":
        name = kind.removeprefix("bad ")
        kw[name] = draw(st.sampled_from(_BAD[name]))
        if name == "num_items":
            kw["reduction"] = "mean"
        refuse = f"{name}={kw[name]!r}"
    return LinearCrossEntropyCase(TensorSpec("hidden", draw_layout(draw, (n, h)), dtype),
                                  TensorSpec("weight", draw_layout(draw, (v, h)), dtype), bias,
                                  draw(st.sampled_from((0.0, 0.3, 1.0))), tuple(sorted(kw.items())), refuse,
                                  draw(SEEDS))


def run_linear_cross_entropy(case: LinearCrossEntropyCase, device: torch.device) -> str:
    bufs = Buffers(device, _generator(case.seed))
    kw = dict(case.kwargs)
    hidden = bufs.make(case.hidden).detach().requires_grad_(True)
    n, h = case.hidden.layout.shape
    v = case.weight.layout.shape[0]
    weight = bufs.make(case.weight, scale=h ** -0.5).detach().requires_grad_(True)
    bias = None if case.bias is None else bufs.make(case.bias).detach().requires_grad_(True)
    gen = bufs.generator
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < case.ignored] = kw["ignore_index"]
    if case.refuse.startswith("a label"):
        labels[int(torch.randint(0, n, (1,), generator=gen))] = v if case.seed % 2 else -5
    labels_d = labels.to(device, torch.int32 if case.refuse == "int32 labels" else torch.int64)

    def call():
        loss = ops.linear_cross_entropy(hidden, weight, labels_d, bias=bias, **kw)
        loss.backward()
        return loss

    outcome, loss = attempt(call, bufs, must_refuse=case.refuse)
    if outcome == REFUSED:
        return f"{REFUSED}: {bufs.refusal}"
    unchanged(bufs, {e[0] for e in bufs.entries})
    leaves = [host64(t).requires_grad_(True) for t in (hidden, weight) + (() if bias is None else (bias,))]
    want = ref.linear_cross_entropy(leaves[0], leaves[1], labels, bias=None if bias is None else leaves[2], **kw)
    want.backward()
    dtype = case.hidden.dtype
    math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if loss.dtype != math_dtype or loss.shape != ():
        fail(f"loss is {loss.dtype}{tuple(loss.shape)}, expected a 0-d {math_dtype}")
    mags = linear_cross_entropy_bounds(*(t.detach() for t in leaves[:2]), None if bias is None else leaves[2].detach(),
                                       labels, **kw)
    close(loss, want, dtype, "loss", mag=mags[0])
    mine_leaves = (hidden, weight, bias)[:len(leaves)]
    for name, mine, theirs, mag in zip(("d hidden", "d weight", "d bias"), mine_leaves, leaves, mags[1:len(leaves) + 1],
                                       strict=False):
        if mine.grad is None:
            fail(f"backward produced no gradient for {name[2:]}")
        close(mine.grad, theirs.grad, dtype, name, mag=mag)
    return COMPARED


# ===================================================================== logprobs, entropy, kl
@dataclass(frozen=True)
class LogitsCase:
    op: str
    logits: tuple[TensorSpec, ...]
    refuse: str
    seed: int

    def __repr__(self) -> str:
        why = f" | must refuse: {self.refuse}" if self.refuse else ""
        return f"{self.op} | " + " | ".join(map(repr, self.logits)) + f"{why} | seed {self.seed}"

    _repr_pretty_ = pretty_repr


@st.composite
def logits_cases(draw, op: str, dtypes: tuple[torch.dtype, ...]) -> LogitsCase:
    dtype = draw(st.sampled_from(dtypes))
    lead = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=2)))
    shape = lead + (draw(st.sampled_from((1, 2, 7, 33))),)
    specs = tuple(TensorSpec(role, draw_layout(draw, shape), dtype)
                  for role in (("logits_p", "logits_q") if op == "kl" else ("logits",)))
    refuse = ""
    if op == "logprobs" and math.prod(lead) and draw(st.sampled_from((False,) * 6 + (True,))):
        refuse = "a label outside [0, V)"
    return LogitsCase(op, specs, refuse, draw(SEEDS))


def run_logits(case: LogitsCase, device: torch.device) -> str:
    bufs = Buffers(device, _generator(case.seed))
    xs = [bufs.make(s, scale=3.0).detach().requires_grad_(True) for s in case.logits]
    shape = case.logits[0].layout.shape
    labels = torch.randint(0, shape[-1], shape[:-1], generator=bufs.generator)
    if case.refuse:
        labels.view(-1)[0] = shape[-1]
    math_dtype = torch.float64 if case.logits[0].dtype == torch.float64 else torch.float32
    grad = bufs.make(TensorSpec("grad_out", Layout.contiguous(shape[:-1]), math_dtype))
    fn = {"logprobs": lambda x: ops.logprobs(x[0], labels.to(device)), "entropy": lambda x: ops.entropy(x[0]),
          "kl": lambda x: ops.kl(x[0], x[1])}[case.op]
    reference = {"logprobs": lambda x: ref.logprobs(x[0], labels), "entropy": lambda x: ref.entropy(x[0]),
                 "kl": lambda x: ref.kl(x[0], x[1])}[case.op]

    def call():
        out = fn(xs)
        out.backward(grad)
        return out

    outcome, out = attempt(call, bufs, must_refuse=case.refuse)
    if outcome == REFUSED:
        return f"{REFUSED}: {bufs.refusal}"
    unchanged(bufs, {e[0] for e in bufs.entries})
    x64 = [host64(x).requires_grad_(True) for x in xs]
    want = reference(x64)
    want.backward(host64(grad))
    if out.dtype != math_dtype:
        fail(f"result is {out.dtype}, expected {math_dtype}")
    zmax = sum(x.detach().abs().amax(-1) for x in x64) + 1 if shape[-1] else None
    close(out, want, case.logits[0].dtype, "forward", mag=zmax)
    for i, (x, t) in enumerate(zip(xs, x64, strict=True)):
        if x.grad is None:
            fail(f"backward produced no gradient for input {i}")
        gmag = (host64(grad).abs() * zmax).unsqueeze(-1).expand_as(t.grad)
        close(x.grad, t.grad, case.logits[0].dtype, f"gradient of input {i}", mag=gmag)
    return COMPARED


def loss_fuzzers(OpFuzz) -> dict:
    """The rows of this module for :func:`polyaccel.testing.conformance.fuzz_ops.op_fuzzers`."""
    return {
        "linear_cross_entropy": OpFuzz(lambda dtypes, fp8: linear_cross_entropy_cases(dtypes),
                                       run_linear_cross_entropy),
        **{op: OpFuzz(lambda dtypes, fp8, op=op: logits_cases(op, dtypes), run_logits)
           for op in ("logprobs", "entropy", "kl")},
    }
