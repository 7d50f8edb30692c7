"""benchmarks/autoep_gpu.py's interleaved step timing, on a fake clock: batch sizes, the rotated order, per-step
medians."""

from __future__ import annotations

import pathlib
import random
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import autoep_gpu  # noqa: E402


class FakeDevice:
    def __init__(self):
        self.syncs = 0

    def synchronize(self):
        self.syncs += 1


def test_blocks_are_timed_in_rotated_rounds_of_back_to_back_steps(monkeypatch):
    rng = random.Random()
    cost = {"a": rng.uniform(0.5e-3, 2e-3), "b": rng.uniform(4e-3, 9e-3), "c": 0.05}  # c: slower than a batch
    clock = [0.0]
    calls = []
    monkeypatch.setattr(autoep_gpu.time, "perf_counter", lambda: clock[0])

    def step(name):
        def fn():
            calls.append(name)
            clock[0] += cost[name]
        return fn

    device = FakeDevice()
    got = autoep_gpu.interleaved_step_s({n: step(n) for n in cost}, device, rounds=4, min_batch_s=0.02, warmup=2)
    assert got == {n: pytest.approx(c) for n, c in cost.items()}
    batch = {n: max(1, -(-0.02 // c)) for n, c in cost.items()}
    timed = calls[3 * len(cost):]  # after each block's 2 warm-up steps and 1 sizing step
    rounds, i = [], 0
    for _ in range(4):
        order = []
        while len(order) < 3:
            name = timed[i]
            assert timed[i:i + int(batch[name])] == [name] * int(batch[name]), "a batch is back-to-back steps"
            order.append(name)
            i += int(batch[name])
        rounds.append(order)
    assert i == len(timed)
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert device.syncs == 2 * len(cost) + 2 * 4 * len(cost), "synchronised around each batch, not each step"


def test_host_side_times_steps_from_an_idle_device_and_counts_one():
    import torch

    device = FakeDevice()
    a = torch.randn(8)
    calls = []

    def step():
        calls.append(1)
        return (a * 2).sum().item()  # mul, sum and a read back to the host

    got = autoep_gpu.host_side(step, device, steps=3)
    assert len(calls) == 4 and device.syncs == 3 + 2, "synchronised before each timed step, around the counted one"
    assert got["launches"] == 3 and got["syncs"] == 1 and got["host_ms"] > 0
