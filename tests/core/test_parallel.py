"""polyaccel.parallel: the per-parameter layout the engine layers hand ZeRO, and recorded plans."""

from __future__ import annotations

import pytest
import torch
from polyaccel.errors import ConfigError
from polyaccel.parallel import DEFAULT, ParamLayout, Split, get_layout, get_plan, set_layout, set_plan


def test_uneven_fused_split_pieces_reassemble_the_full_tensor():
    full = torch.randn(3 + 2 + 2 + 1, 5)  # [q | k] with q split 3/2 and k split 2/1 over two ranks
    sp = Split("tensor", 0, ((3, 2), (2, 1)), rank=1)
    pieces = [sp.piece(full, r) for r in range(2)]
    assert torch.equal(pieces[0], torch.cat([full[0:3], full[5:7]]))
    assert torch.equal(pieces[1], torch.cat([full[3:5], full[7:8]]))
    assert torch.equal(sp.piece(full), pieces[1])
    assert torch.equal(sp.assemble(pieces), full)
    assert (sp.degree, sp.full_length, sp.local_length(0), sp.local_length()) == (2, 8, 5, 3)


def test_split_along_columns_with_a_rank_holding_nothing():
    full = torch.randn(4, 6)
    sp = Split("expert", 1, ((4, 2, 0),), rank=2)
    assert sp.piece(full).shape == (4, 0)
    assert torch.equal(sp.assemble([sp.piece(full, r) for r in range(3)]), full)


def test_bad_layouts_are_refused_with_the_allowed_values():
    with pytest.raises(ConfigError, match="'data', 'expert_data'"):
        ParamLayout(replicas="tensor")
    with pytest.raises(ConfigError, match="grad_sum"):
        ParamLayout(grad_sum="expert")
    with pytest.raises(ConfigError, match="'tensor', 'expert'"):
        Split("data", 0, ((1, 1),), 0)
    with pytest.raises(ConfigError, match="one size per rank"):
        Split("tensor", 0, ((1, 1), (1,)), 0)
    with pytest.raises(TypeError):
        set_layout(torch.nn.Parameter(torch.ones(1)), {"replicas": "data"})


def test_layouts_and_plans_attach_to_parameters_and_models():
    p = torch.nn.Parameter(torch.ones(2))
    assert get_layout(p) is DEFAULT
    layout = ParamLayout(replicas="expert_data", split=Split("expert", 0, ((1, 1),), 0))
    set_layout(p, layout)
    assert get_layout(p) is layout
    model = torch.nn.Linear(2, 2)
    assert get_plan(model, "tensor") is None
    set_plan(model, "tensor", "plan")
    assert get_plan(model, "tensor") == "plan" and get_plan(model, "expert") is None
    with pytest.raises(ConfigError):
        set_plan(model, "data", "plan")
