"""The contract of muon_momentum and muon_apply: every bad call is refused with OpArgumentError naming the bad
input, before any tensor is touched."""

from __future__ import annotations

import math

import polyaccel.ops as ops
import pytest
import torch
from polyaccel.errors import OpArgumentError


def _momentum_call(**change):
    torch.manual_seed(0)
    t = {"grad": torch.randn(20).to(torch.bfloat16), "momentum_buffer": torch.randn(20), "out": torch.randn(30)}
    kw = dict(grad_offsets=[0, 10], buffer_offsets=[0, 10], out_offsets=[0, 20], lengths=[10, 10], momentum=0.9,
              nesterov=True)
    for k, v in change.items():
        (t if k in t else kw)[k] = v(t) if callable(v) else v
    return t, kw


MOMENTUM_BAD = {
    "momentum NaN": ({"momentum": math.nan}, "momentum"),
    "momentum 1": ({"momentum": 1.0}, "momentum"),
    "nesterov not a bool": ({"nesterov": 1}, "nesterov"),
    "2-D buffer": ({"momentum_buffer": lambda t: t["momentum_buffer"].view(4, 5)}, "momentum_buffer"),
    "strided out": ({"out": lambda t: torch.randn(60)[::2]}, "out"),
    "bf16 buffer": ({"momentum_buffer": lambda t: torch.randn(20).to(torch.bfloat16)}, "momentum_buffer"),
    "fp64 grad, fp32 buffer": ({"grad": lambda t: torch.randn(20, dtype=torch.float64)}, "float64"),
    "integer grad": ({"grad": lambda t: torch.ones(20, dtype=torch.int32)}, "grad"),
    "other device": ({"out": lambda t: torch.randn(30, device="meta")}, "out"),
    "a table too short": ({"out_offsets": [0]}, "out_offsets"),
    "an offset not an int": ({"grad_offsets": [0, 10.0]}, "grad_offsets"),
    "a negative length": ({"lengths": [10, -1]}, "lengths"),
    "past the end": ({"out_offsets": [0, 25]}, "past"),
    "overlapping out pieces": ({"out_offsets": [0, 5]}, "overlap"),
    "overlapping buffer pieces": ({"buffer_offsets": [0, 9]}, "overlap"),
    "out is the buffer": ({"out": lambda t: t["momentum_buffer"], "out_offsets": [0, 10]}, "share memory"),
}


@pytest.mark.parametrize("case", list(MOMENTUM_BAD))
def test_muon_momentum_refuses_bad_calls_untouched(case):
    change, words = MOMENTUM_BAD[case]
    t, kw = _momentum_call(**change)
    before = {k: v.clone() for k, v in t.items() if v.device.type == "cpu"}
    with pytest.raises(OpArgumentError, match=words):
        ops.muon_momentum(t["grad"], t["momentum_buffer"], t["out"], **kw)
    for k, v in before.items():
        assert torch.equal(t[k], v), f"{k} was modified by a refused call"


def _apply_call(**change):
    torch.manual_seed(0)
    t = {"params": torch.randn(20), "updates": torch.randn(30).to(torch.bfloat16)}
    kw = dict(param_offsets=[0, 10], update_offsets=[0, 20], lengths=[10, 10], lr=0.02, weight_decays=[0.1, 0.0],
              lr_scales=[1.0, 2.0])
    for k, v in change.items():
        (t if k in t else kw)[k] = v(t) if callable(v) else v
    return t, kw


APPLY_BAD = {
    "lr NaN": ({"lr": math.nan}, "lr"),
    "lr negative": ({"lr": -0.1}, "lr"),
    "weight decay NaN": ({"weight_decays": [math.nan, 0.0]}, r"weight_decays\[0\]"),
    "scale infinite": ({"lr_scales": [1.0, math.inf]}, r"lr_scales\[1\]"),
    "a decay missing": ({"weight_decays": [0.1]}, "weight_decays"),
    "updates wider than params": ({"updates": lambda t: torch.randn(30, dtype=torch.float64)}, "wider"),
    "overlapping params": ({"param_offsets": [0, 5]}, "overlap"),
    "past the end": ({"update_offsets": [0, 21]}, "past"),
    "updates in params": ({"updates": lambda t: t["params"], "update_offsets": [0, 10]}, "share memory"),
}


@pytest.mark.parametrize("case", list(APPLY_BAD))
def test_muon_apply_refuses_bad_calls_untouched(case):
    change, words = APPLY_BAD[case]
    t, kw = _apply_call(**change)
    before = {k: v.clone() for k, v in t.items()}
    with pytest.raises(OpArgumentError, match=words):
        ops.muon_apply(t["params"], t["updates"], **kw)
    for k, v in before.items():
        assert torch.equal(t[k], v), f"{k} was modified by a refused call"


def test_valid_calls_match_float64_and_leave_the_rest_alone():
    t, kw = _momentum_call()
    b64, o64 = t["momentum_buffer"].double(), t["out"].double()
    ops.muon_momentum(t["grad"], t["momentum_buffer"], t["out"], **kw)
    from polyaccel.ops.reference import muon_passes as ref

    ref.muon_momentum(t["grad"].double(), b64, o64, **kw)
    torch.testing.assert_close(t["momentum_buffer"].double(), b64, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(t["out"].double(), o64, rtol=1e-6, atol=1e-7)
    assert torch.equal(t["out"][10:20].double(), o64[10:20])  # between the pieces: untouched
