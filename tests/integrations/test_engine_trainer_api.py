"""The engine API the trainers drive: ``step(boundary=...)``, ``get_global_grad_norm()``, ``was_step_applied()``
and ``last_step_skipped`` (fp16 overflow), on a real ZeRO engine in one process (float64), against plain torch."""

from __future__ import annotations

import math

import pytest
import torch


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)).double()


def _batches(n):
    g = torch.Generator().manual_seed(9)
    return [torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(n)]


def _loss(model, x):
    return model(x).sin().square().mean()


def test_step_boundary_follows_the_trainer_and_reports_the_norm():
    """gas 4, windows of 4, 2 (an epoch's short end) and 4 micro-batches, chosen by the caller: the optimizer steps
    at the windows' ends with the mean gradient of each window, as torch's SGD on the same windows does."""
    import polyaccel

    windows = [4, 2, 4]
    engine = polyaccel.initialize(_model(), {"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2},
                                             "optimizer": {"type": "adamw", "params": {"lr": 0.05}}})
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.0)
    xs = iter(_batches(sum(windows)))
    try:
        assert engine.get_global_grad_norm() is None
        applied, norms, ref_norms = [], [], []
        for size in windows:
            for i in range(size):
                x = next(xs)
                # the engine divides by its gradient_accumulation_steps (4); the window's mean needs 1 / size
                engine.backward(_loss(engine, x) * (4 / size))
                (_loss(ref, x) / size).backward()
                applied.append(engine.step(boundary=i == size - 1))
                assert engine.was_step_applied() == applied[-1]
            norms.append(engine.get_global_grad_norm())
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf)))
            opt.step()
            opt.zero_grad()
        assert applied == [False, False, False, True, False, True, False, False, False, True]
        assert engine.global_steps == 3 and not engine.last_step_skipped
        torch.testing.assert_close(norms, ref_norms, rtol=1e-12, atol=0)
        full = engine.full_state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=1e-12)
    finally:
        engine.destroy()


def test_boundary_false_with_one_micro_step_is_refused():
    import polyaccel

    engine = polyaccel.initialize(_model(), {"optimizer": {"type": "adamw", "params": {"lr": 0.05}}})
    try:
        engine.backward(_loss(engine, _batches(1)[0]))
        with pytest.raises(polyaccel.ConfigError, match="gradient_accumulation_steps 1"):
            engine.step(boundary=False)
    finally:
        engine.destroy()


def test_skipped_step_signal_on_fp16_overflow():
    """ZeRO's dynamic loss scale on the float64 model (powers of two scale exactly); an infinite loss: the step is
    skipped, signalled, and the weights stay; the next step applies."""
    import polyaccel
    from polyaccel.engines.zero.config import Fp16Config
    from polyaccel.engines.zero.loss_scaler import LossScaler

    engine = polyaccel.initialize(_model(), {"optimizer": {"type": "adamw", "params": {"lr": 0.05}}})
    engine.scaler = LossScaler(Fp16Config(enabled=True, initial_scale_power=8, hysteresis=1))
    x1, x2 = _batches(2)
    try:
        before = {k: v.clone() for k, v in engine.full_state_dict().items()}
        engine.backward(_loss(engine, x1) * float("inf"))
        assert engine.step() is False
        assert engine.last_step_skipped and not engine.was_step_applied()
        assert engine.get_global_grad_norm() == math.inf and engine.skipped_steps == 1
        after = engine.full_state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())
        engine.backward(_loss(engine, x2))
        assert engine.step() is True
        assert not engine.last_step_skipped and engine.was_step_applied()
        assert math.isfinite(engine.get_global_grad_norm()) and engine.get_global_grad_norm() > 0
    finally:
        engine.destroy()
