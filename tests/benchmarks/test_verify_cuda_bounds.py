"""benchmarks/verify_cuda.py's error bounds: a correct fp32 step passes, a wrong formula fails.

The Triton LAMB runs under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py sets it), on
verify_cuda's own hyperparameters and on tensors of one and a few elements, where the fp32
rounding of exp_avg_sq's *value* exceeds 1e-4 of its change (the bare ratio failed there).
"""

from __future__ import annotations

import pathlib
import sys

import torch
from polyaccel.ops.reference import optimizers as ref
from polyaccel.plugins.cuda.kernels import optimizers as K

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import verify_cuda  # noqa: E402

LAMB = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.05)


def test_one_ulp_of_a_barely_changing_fp32_state_is_within_the_bound():
    # v with g*g close to v: the step changes v by ~1e-3 |g^2 - v|, fp32 rounds v by ~1e-7 v
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    v0 = torch.rand(3, generator=g, dtype=torch.float64) + 0.25
    grad = (v0 * (1 + 1e-3 * torch.randn(3, generator=g, dtype=torch.float64))).sqrt().float()
    v32 = v0.float()
    got = 0.999 * v32 + (1 - 0.999) * grad * grad  # two fp32 roundings, as an unfused kernel does
    want = 0.999 * v32.double() + 1e-3 * grad.double() ** 2
    assert float((got.double() - want).abs().max()) > 0  # the rounding is there
    assert verify_cuda._excess(got, want, v32) <= 0
    wrong = 0.99 * v32 + (1 - 0.99) * grad * grad  # a wrong beta2 misses by about the whole change
    assert verify_cuda._excess(wrong, want, v32) > 0


def test_triton_lamb_on_few_element_tensors_passes_verify_cuda_bounds():
    sizes = [1, 3, 1, 2, 5, 4097 // 64, 1]
    for p_dt in (torch.float32, torch.bfloat16, torch.float16):
        for seed in range(3):
            lists = verify_cuda._lists(sizes, p_dt, torch.float32, 2, torch.device("cpu"), 1000 + seed)
            before = [[t.clone() for t in lst] for lst in lists]
            want = [[t.double() for t in lst] for lst in lists]
            K.fused_lamb(*lists, step=3, **LAMB)
            ref.fused_lamb(*want, step=3, **LAMB)
            pick = lambda x: [x[0], x[2], x[3]]  # noqa: E731
            excess, where = verify_cuda._worst(pick(lists), pick(want), pick(before))
            assert excess <= 0, f"{p_dt} seed {seed}: {excess:.3g} at {where}"


def test_a_wrong_trust_ratio_is_caught_and_located():
    lists = verify_cuda._lists([7, 300], torch.float16, torch.float32, 2, torch.device("cpu"), 7)
    before = [[t.clone() for t in lst] for lst in lists]
    want = [[t.double() for t in lst] for lst in lists]
    K.fused_lamb(*lists, step=3, **{**LAMB, "max_coeff": 1.01, "min_coeff": 1.0})  # trust 1 instead of |p|/|u|
    ref.fused_lamb(*want, step=3, **LAMB)
    pick = lambda x: [x[0], x[2], x[3]]  # noqa: E731
    excess, where = verify_cuda._worst(pick(lists), pick(want), pick(before))
    assert excess > 0 and where.startswith("param[") and "fp64" in where and "before" in where
