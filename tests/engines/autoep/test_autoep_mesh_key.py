"""A mesh that cannot hold the asked expert degree is refused naming the config key that asked for it."""

from __future__ import annotations

from polyaccel.testing.multiprocess import run_ranks


def initialize_error(rank, world, config):
    import polyaccel
    import torch

    try:
        polyaccel.initialize(torch.nn.Linear(4, 4), config)
    except polyaccel.ConfigError as exc:
        return str(exc)
    return None


def test_expert_degree_that_does_not_fit_the_data_ranks_names_autoep_size():
    config = {"expert_parallel": {"autoep_size": 3}, "optimizer": {"type": "adamw", "params": {"lr": 1e-3}}}
    (message,) = run_ranks(initialize_error, 1, config, timeout=90)
    assert message is not None and "\n" not in message
    assert message.startswith("'expert_parallel.autoep_size'=3: expert=3 must divide data=1"), message
    assert "sizes that fit: [1]" in message
