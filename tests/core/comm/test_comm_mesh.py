"""The data x tensor x expert mesh: group membership and collectives over each dimension (4 ranks)."""

from __future__ import annotations

import pytest
import torch
from polyaccel import ConfigError, comm
from polyaccel.comm.mesh import init_parallel_mesh
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(120)


def mesh_groups(rank: int, world: int, layouts: list[dict]) -> list[dict]:
    out = []
    for layout in layouts:
        mesh = init_parallel_mesh(**layout)
        info = {}
        for dim in ("data", "tensor", "expert", "expert_data"):
            ranks = mesh.ranks(dim)
            # the group really connects those ranks: sum a value only they contribute
            t = torch.tensor([float(2 ** rank)], dtype=torch.float64)
            comm.all_reduce(t, group=mesh.group(dim))
            info[dim] = {"ranks": ranks, "size": mesh.size(dim), "rank": mesh.rank(dim),
                         "sum_ok": t.item() == sum(2.0 ** r for r in ranks)}
        out.append(info)
    errors = []
    for bad in ({"tensor": 3}, {"data": 3, "tensor": 1}, {"expert": 3}, {"tensor": 0}):
        try:
            init_parallel_mesh(**bad)
        except ConfigError as exc:
            errors.append(str(exc))
    try:
        init_parallel_mesh().size("pipeline")
    except ConfigError as exc:
        errors.append(str(exc))
    return [out, errors]


def test_mesh_dimensions_on_four_ranks():
    layouts = [{"tensor": 2}, {"expert": 2}]
    results = run_ranks(mesh_groups, 4, layouts, timeout=90)
    for rank, (infos, errors) in enumerate(results):
        tp, ep = infos
        # data=2 x tensor=2: tensor groups are adjacent ranks, data groups stride by 2
        assert tp["tensor"]["ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert tp["data"]["ranks"] == [rank % 2, rank % 2 + 2]
        assert tp["expert"]["ranks"] == [rank] and tp["expert_data"]["ranks"] == tp["data"]["ranks"]
        assert tp["tensor"]["rank"] == rank % 2 and tp["data"]["rank"] == rank // 2
        # data=4 with expert=2: experts over adjacent ranks, expert replicas stride by 2
        assert ep["data"]["ranks"] == [0, 1, 2, 3] and ep["data"]["rank"] == rank
        assert ep["expert"]["ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert ep["expert_data"]["ranks"] == [rank % 2, rank % 2 + 2]
        assert ep["tensor"]["ranks"] == [rank]
        assert (ep["expert"]["size"], ep["expert_data"]["size"], ep["data"]["size"]) == (2, 2, 4)
        assert all(d["sum_ok"] for info in infos for d in info.values())
        assert len(errors) == 5
        assert "tensor=3 does not divide the world size 4" in errors[0]
        assert "pass data=-1" in errors[1]
        assert "expert=3 must divide data=4" in errors[2]
        assert "tensor must be a positive int" in errors[3]
        assert "unknown mesh dimension 'pipeline'" in errors[4]
