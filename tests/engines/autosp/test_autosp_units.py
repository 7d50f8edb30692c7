"""AutoSP's checks, in one process: the config section, heads over sequence (and tensor) ranks, attention
modules and implementations it cannot split, and the exchange's layout against plain indexing."""

from __future__ import annotations

import autosp_testlib as lib
import pytest
import torch
from polyaccel import ConfigError
from polyaccel.engines.autosp import check_heads, parse, plan_sequence_parallel
from polyaccel.engines.autosp import layer as sp_layer


def test_config_section_refusals_name_the_key():
    assert parse({"autosp_size": 4}).autosp_size == 4 and parse({"autosp_size": 2, "seq_dim": 1}).seq_dim == 1
    for bad, words in (({}, "autosp_size' is required"),
                       ({"autosp_size": 0}, "autosp_size' must be an integer >= 1"),
                       ({"autosp_size": True}, "autosp_size' must be an integer"),
                       ({"autosp_size": 2, "seq_dim": 0}, "seq_dim' is 0"),
                       ({"autosp_size": 2, "ulysses": 1}, "unknown config key 'sequence_parallel.ulysses'"),
                       ([], "must be a dict")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            parse(bad)
    section = {"autosp_size": 2}
    assert sp_layer.mesh_sizes(section) == {"sequence": 2} and section == {"autosp_size": 2}


def test_heads_split_or_refused_with_the_valid_sizes():
    assert check_heads((8,), (8,), 4) == 1
    assert check_heads((8,), (2,), 4) == 2  # 2 KV heads -> 4: one per rank
    assert check_heads((8,), (2,), 8) == 4
    assert check_heads((6,), (3,), 2) == 2  # 3 KV heads do not split over 2: 6 copies, 3 per rank
    assert check_heads((4,), (1,), 2) == 2  # multi-query attention
    with pytest.raises(ConfigError, match=r"autosp_size 3: 4 query heads do not split .* \[1, 2, 4\]"):
        check_heads((4,), (2,), 3)
    with pytest.raises(ConfigError, match=r"3 query heads on tensor rank 0 \(of 2\) .* \[1, 3\]"):
        check_heads((3, 3), (1, 1), 2)


def test_plan_reads_the_model_and_refuses_what_it_cannot_split():
    plan = plan_sequence_parallel(lib.llama(), {"autosp_size": 4})
    assert (plan.implementation, len(plan.attention), plan.kv_replication) == ("sdpa", 2, 2)
    with pytest.raises(ConfigError, match=r"8 query heads|4 query heads do not split over 8"):
        plan_sequence_parallel(lib.llama(), {"autosp_size": 8})
    model = lib.llama()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="this model uses 'flex_attention'"):
        plan_sequence_parallel(model, {"autosp_size": 2})

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = lib.llama().config
            self.inner = lib.llama()
            self.extra = torch.nn.MultiheadAttention(8, 2)

    with pytest.raises(ConfigError, match=r"extra \(torch.nn.modules.activation.MultiheadAttention\)"):
        plan_sequence_parallel(Net(), {"autosp_size": 2})
