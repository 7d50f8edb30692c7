"""benchmarks/zero_profile.py's phase table on the cpu plugin: forward, backward and step each with their time, host
share, garbage-collector time and allocator counts; a collection run inside one phase is charged to that phase."""

from __future__ import annotations

import gc
import pathlib
import re
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import zero_profile  # noqa: E402


def _engine():
    import polyaccel
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    return polyaccel.initialize(LlamaForCausalLM(cfg), {"zero_optimization": {"stage": 1},
                                                        "optimizer": {"type": "adamw", "params": {"lr": 1e-3}}})


def _table(text: str) -> dict[str, dict[str, float]]:
    rows = {}
    for line in text.splitlines()[1:]:
        name, rest = line.split(maxsplit=1)
        rows[name] = {k.strip(): float(v) for k, v in re.findall(r"([a-z_ ]+?) (-?[\d.]+)(?:,|$)", rest.strip())}
    return rows


def test_phases_report_time_host_share_gc_and_allocations():
    engine = _engine()
    try:
        step = engine.step

        def step_with_a_collection():
            gc.collect()
            step()

        engine.step = step_with_a_collection
        acc = engine.accelerator
        data = [torch.randint(0, 128, (2, 8)) for _ in range(3)]
        rows = _table(zero_profile.phase_times(engine, acc, data))
    finally:
        engine.destroy()
    assert list(rows) == ["forward", "backward", "step"]
    for name, row in rows.items():
        assert set(row) == {"ms", "host ms", "gc ms", "num_device_alloc", "num_alloc_retries",
                            "num_sync_all_streams"}, row
        assert 0 < row["host ms"] <= row["ms"] + 1e-6, (name, row)
    assert rows["step"]["gc ms"] > 0
    assert rows["forward"]["gc ms"] < rows["step"]["gc ms"]
