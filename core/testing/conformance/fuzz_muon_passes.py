"""The op fuzz suite's strategies and runners for ``muon_momentum`` and ``muon_apply``.

Drawn: up to four pieces of lengths down to zero at shuffled offsets of flat buffers (with elements between and
around them, which must stay untouched), the dtypes, Nesterov or not, hyperparameters; now and then a call the
contract says must be refused (a bad hyperparameter, two written pieces overlapping, a piece past its buffer's
end, a strided buffer, a momentum buffer of a 16-bit dtype), for which only an honest refusal passes. The
reference runs on float64 copies; the read buffers must come back bitwise unchanged.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import polyaccel.ops as ops
import torch
from hypothesis import strategies as st
from polyaccel.ops import reference as ref

from .fuzz_layouts import Buffers, Layout, TensorSpec, host64
from .fuzz_outcome import COMPARED, REFUSED, attempt, close, pretty_repr, unchanged
from .opcases_muon_passes import layout

SEEDS = st.integers(0, 2**31 - 1)
_KINDS = st.sampled_from(("valid",) * 8 + ("bad setting", "overlapping pieces", "past the end", "strided buffer"))
MOMENTUM_BAD = {"momentum": (1.0, -0.1, math.nan, math.inf)}
APPLY_BAD = {"lr": (-1e-3, math.nan, math.inf), "weight_decay": (-0.1, math.nan), "lr_scale": (math.inf, -1.0)}


@dataclass(frozen=True)
class PassCase:
    op: str
    specs: tuple[TensorSpec, ...]  # the flat buffers
    offsets: tuple[tuple[int, ...], ...]  # per buffer
    lengths: tuple[int, ...]
    hyper: tuple[tuple[str, object], ...]
    seed: int
    refuse: str = ""

    def __repr__(self) -> str:
        hyper = " ".join(f"{k}={v!r}" for k, v in self.hyper)
        parts = [f"{self.op}: {hyper} lengths={self.lengths} offsets={self.offsets}; seed {self.seed}"]
        parts += [repr(s) for s in self.specs]
        if self.refuse:
            parts.append(f"must refuse: {self.refuse}")
        return " | ".join(parts)

    _repr_pretty_ = pretty_repr


def _buffers(draw, op: str, roles, dtypes, kind: str):
    """(specs, offsets, lengths, refuse) for the flat buffers ``roles`` of ``dtypes``, with ``kind``'s defect."""
    lengths = draw(st.lists(st.integers(0 if kind == "valid" else 1, 40), min_size=1 if kind != "valid" else 0,
                            max_size=4))
    rng = random.Random(draw(SEEDS))
    specs, offsets, refuse = [], [], ""
    for k, (role, dtype) in enumerate(zip(roles, dtypes, strict=True)):
        offs, size = layout(lengths, rng, gap=draw(st.integers(0, 3)))
        lay = Layout.contiguous((size,), offset=draw(st.integers(0, 2)))
        if k == 1 and kind == "overlapping pieces" and len(lengths) > 1:
            offs[1] = offs[0]
            refuse = f"two overlapping pieces of {role}"
        elif k == 0 and kind == "past the end":
            offs[0] = size - lengths[0] + 1
            refuse = f"piece 0 of {role} past its end"
        elif k == 1 and kind == "strided buffer":
            lay = Layout((size,), (2,), 0, 2 * size)
            refuse = f"a strided {role}" if size > 1 else ""
        specs.append(TensorSpec(role, lay, dtype))
        offsets.append(tuple(offs))
    return tuple(specs), tuple(offsets), tuple(lengths), refuse


@st.composite
def muon_momentum_cases(draw, dtypes: tuple[torch.dtype, ...]) -> PassCase:
    g_dtype = draw(st.sampled_from(dtypes))
    b_dtype = torch.float64 if g_dtype == torch.float64 else torch.float32
    o_dtype = draw(st.sampled_from(dtypes))
    kind = draw(_KINDS)
    hyper = {"momentum": draw(st.sampled_from((0.95, 0.0, 0.3, 0.5))), "nesterov": draw(st.booleans())}
    bad_buffer = kind == "bad setting" and draw(st.booleans()) and g_dtype != torch.float64
    if bad_buffer:
        b_dtype = draw(st.sampled_from((torch.bfloat16, torch.float16)))
    specs, offsets, lengths, refuse = _buffers(draw, "muon_momentum", ("grad", "momentum_buffer", "out"),
                                               (g_dtype, b_dtype, o_dtype), kind)
    if bad_buffer:
        refuse = f"a {b_dtype} momentum buffer"
    elif kind == "bad setting":
        hyper["momentum"] = draw(st.sampled_from(MOMENTUM_BAD["momentum"]))
        refuse = f"momentum={hyper['momentum']!r}"
    return PassCase("muon_momentum", specs, offsets, lengths, tuple(hyper.items()), draw(SEEDS), refuse)


@st.composite
def muon_apply_cases(draw, dtypes: tuple[torch.dtype, ...]) -> PassCase:
    p_dtype = draw(st.sampled_from(dtypes))
    u_dtype = draw(st.sampled_from([d for d in dtypes if d.itemsize <= p_dtype.itemsize]))
    kind = draw(_KINDS)
    if kind == "overlapping pieces":
        kind = "overlapping params"
    specs, offsets, lengths, refuse = _buffers(draw, "muon_apply", ("updates", "params"), (u_dtype, p_dtype),
                                               "overlapping pieces" if kind == "overlapping params" else kind)
    n = len(lengths)
    hyper = {"lr": draw(st.sampled_from((0.02, 0.0, 0.5))),
             "weight_decays": tuple(draw(st.sampled_from((0.0, 0.1, 0.01))) for _ in range(n)),
             "lr_scales": tuple(draw(st.sampled_from((1.0, 2.5, 0.2))) for _ in range(n))}
    if kind == "bad setting":
        key = draw(st.sampled_from(sorted(APPLY_BAD)))
        value = draw(st.sampled_from(APPLY_BAD[key]))
        if key == "lr":
            hyper["lr"] = value
        elif n:
            name = "weight_decays" if key == "weight_decay" else "lr_scales"
            hyper[name] = (value,) + hyper[name][1:]
        refuse = f"{key}={value!r}" if key == "lr" or n else ""
    return PassCase("muon_apply", specs, offsets, lengths, tuple(hyper.items()), draw(SEEDS), refuse)


def run_muon_momentum(case: PassCase, device: torch.device) -> str:
    bufs = Buffers(device, torch.Generator().manual_seed(case.seed))
    grad, buf, out = (bufs.make(s, scale=0.1 if s.role == "momentum_buffer" else 1.0) for s in case.specs)
    go, bo, oo = (list(o) for o in case.offsets)
    kw = dict(case.hyper, grad_offsets=go, buffer_offsets=bo, out_offsets=oo, lengths=list(case.lengths))
    b64, o64 = host64(buf), host64(out)
    outcome, _ = attempt(lambda: ops.muon_momentum(grad, buf, out, **kw), bufs, case.refuse)
    if outcome == REFUSED:
        return f"{REFUSED}: {bufs.refusal}"
    unchanged(bufs, {"grad"})
    ref.muon_momentum(host64(grad), b64, o64, **kw)
    close(buf, b64, buf.dtype, "momentum_buffer")
    close(out, o64, out.dtype, "out")
    return COMPARED


def run_muon_apply(case: PassCase, device: torch.device) -> str:
    bufs = Buffers(device, torch.Generator().manual_seed(case.seed))
    upd, params = (bufs.make(s) for s in case.specs)
    uo, po = (list(o) for o in case.offsets)
    hyper = dict(case.hyper)
    kw = dict(param_offsets=po, update_offsets=uo, lengths=list(case.lengths), lr=hyper["lr"],
              weight_decays=list(hyper["weight_decays"]), lr_scales=list(hyper["lr_scales"]))
    p64, start = host64(params), host64(params)
    outcome, _ = attempt(lambda: ops.muon_apply(params, upd, **kw), bufs, case.refuse)
    if outcome == REFUSED:
        return f"{REFUSED}: {bufs.refusal}"
    unchanged(bufs, {"updates"})
    u64 = host64(upd)
    ref.muon_apply(p64, u64, **kw)
    # the terms' sizes bound the rounding (the sum may cancel): |p| + lr * scale * |O| per element
    mag = start.abs().clone()
    for o, q, n, s in zip(po, uo, case.lengths, hyper["lr_scales"], strict=True):
        mag[o:o + n] += hyper["lr"] * s * u64[q:q + n].abs()
    close(params, p64, params.dtype, "params", mag=mag)
    return COMPARED


__all__ = ["PassCase", "muon_apply_cases", "muon_momentum_cases", "run_muon_apply", "run_muon_momentum"]
