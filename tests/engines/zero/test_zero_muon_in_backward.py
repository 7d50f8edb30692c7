"""Muon stepped on the device during backward (one rank, stages 1 and 2): when it runs, when it does not, and
that it takes the step after backward's numbers, a matrix without a gradient and a shared weight included.

On the cpu plugin the partition's master is host memory, which the Muon optimizer keeps in its host buffers by
default; the tests force the device form (``kept_buffers = False``) that a GPU partition takes."""

from __future__ import annotations

import pytest
import torch
from muon_testlib import muon_config
from polyaccel.errors import ConfigError


class WithUnused(torch.nn.Module):
    """Two matrices in use and a third that never gets a gradient (it still decays)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(12, 20, bias=False)
        self.b = torch.nn.Linear(20, 12, bias=False)
        self.unused = torch.nn.Linear(12, 12, bias=False)
        self.norm = torch.nn.LayerNorm(12)

    def forward(self, x):
        return self.norm(self.b(torch.tanh(self.a(x))))


class SharedTwice(torch.nn.Module):
    """``lin`` runs inside a reentrant checkpoint and again outside it: its gradient hook fires twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8, bias=False)
        self.head = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=True)
        return self.head(self.lin(torch.tanh(h)))


def _engine(model, stage=1, clip=0.0, **params):
    import polyaccel

    cfg = muon_config(stage, bucket=300, **params)
    if clip:
        cfg["gradient_clipping"] = clip
    engine = polyaccel.initialize(model, cfg)
    engine.optimizer.kept_buffers = False  # the device partition's form (see the module docstring)
    return engine


def _train(model, steps=3, **kw):
    """Returns the parameters after ``steps`` steps and, per step, how many matrices were orthogonalized by the
    end of backward (before ``step``) and by the end of the step."""
    engine = _engine(model, **kw)
    counts = []
    try:
        for step in range(steps):
            x = torch.randn(6, 12, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
            engine.backward(engine(x).square().mean())
            in_backward = engine.optimizer.orthogonalized
            assert engine.step() is True
            counts.append((in_backward, engine.optimizer.orthogonalized))
        return {k: v.clone() for k, v in engine.full_state_dict().items()}, counts
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_matrices_are_stepped_during_backward_with_the_numbers_of_the_step_after_it(stage):
    after, after_counts = _train(WithUnused().double(), stage=stage, step_in_backward=False)
    during, counts = _train(WithUnused().double(), stage=stage)
    # three Muon matrices a step, all orthogonalized by the end of backward (the unused one when its bucket
    # is reduced at backward's end); after backward when switched off
    assert counts == [(3, 3), (6, 6), (9, 9)]
    assert after_counts == [(0, 3), (3, 6), (6, 9)]
    # fp64 (the bf16 iteration is compared bit for bit in test_zero_muon_paths): a bucket at a time, the vector
    # units' fused multiply-adds and the batched products' blocking fall elsewhere: 1e-12 where a wrong step
    # would be off by a whole update (lr 0.02)
    for key, want in after.items():
        torch.testing.assert_close(during[key], want, rtol=0, atol=1e-12, msg=lambda m, k=key: f"{k}: {m}")
    assert not torch.equal(during["unused.weight"], WithUnused().double().unused.weight.detach())  # decayed


def test_clipping_steps_after_backward():
    _, counts = _train(WithUnused().double(), clip=1.0)
    assert counts == [(0, 3), (3, 6), (6, 9)]


def test_stage_3_steps_after_backward():
    engine = _engine(WithUnused().double(), stage=3)
    try:
        assert engine.optimizer.steps_in_backward  # the optimizer could ...
        x = torch.randn(6, 12, dtype=torch.float64)
        engine.backward(engine(x).square().mean())
        assert engine.optimizer.orthogonalized == 0  # ... but stage 3 steps after backward
        engine.step()
        assert engine.optimizer.orthogonalized == 3
    finally:
        engine.destroy()


def test_a_second_gradient_after_its_matrix_was_stepped_is_refused_with_the_fix():
    from polyaccel.engines.zero.host_step import OverlapError

    engine = _engine(SharedTwice().double(), stage=2)
    try:
        x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
        with pytest.raises(OverlapError, match=r"'lin\.weight'.*step_in_backward to false"):
            engine.backward(engine(x).square().sum())
    finally:
        engine.destroy()
    engine = _engine(SharedTwice().double(), stage=2, step_in_backward=False)
    try:
        engine.backward(engine(x).square().sum())
        assert engine.step() is True
    finally:
        engine.destroy()


def test_step_in_backward_must_be_a_bool():
    with pytest.raises(ConfigError, match="step_in_backward"):
        _engine(WithUnused().double(), step_in_backward="yes")
