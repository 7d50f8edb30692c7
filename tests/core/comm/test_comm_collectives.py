"""Every collective of polyaccel.comm against the same math done in one process in float64 (gloo, 2 and 4 ranks).

Each rank builds every rank's inputs from a shared seed, so it can compute the expected result
locally in float64 and compare what the collective gave it. One spawned run checks all collectives.
"""

from __future__ import annotations

import pytest
import torch
from polyaccel import comm
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(120)


def _inputs(seed: int, world: int, shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]


def _close(actual, expected64, what, dtype=torch.float32):
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(actual.double(), expected64, rtol=tol, atol=tol * 4, msg=lambda m: f"{what}: {m}")


def check_all_collectives(rank: int, world: int, seed: int) -> dict:
    """Run each collective on fresh random inputs; return what was checked (asserts inside)."""
    checked = []
    for dtype in (torch.float32, torch.float64):
        # all_reduce: SUM and MAX
        xs = _inputs(seed + 1, world, (5, 3), dtype)
        t = xs[rank].clone()
        assert comm.all_reduce(t) is None
        _close(t, sum(x.double() for x in xs), f"all_reduce SUM {dtype}", dtype)
        t = xs[rank].clone()
        comm.all_reduce(t, op=comm.ReduceOp.MAX)
        _close(t, torch.stack([x.double() for x in xs]).amax(0), f"all_reduce MAX {dtype}", dtype)
        # async form returns a handle
        t = xs[rank].clone()
        h = comm.all_reduce(t, async_op=True)
        assert isinstance(h, comm.CommHandle)
        h.wait()
        _close(t, sum(x.double() for x in xs), "all_reduce async", dtype)

        # reduce_scatter_tensor: input is world chunks of the output's shape
        xs = _inputs(seed + 2, world, (world * 4, 3), dtype)
        out = torch.full((4, 3), float("nan"), dtype=dtype)
        inp = xs[rank].clone()
        comm.reduce_scatter_tensor(out, inp)
        full = sum(x.double() for x in xs)
        _close(out, full[rank * 4:(rank + 1) * 4], f"reduce_scatter_tensor {dtype}", dtype)
        assert torch.equal(inp, xs[rank]), "reduce_scatter_tensor modified its input"

        # all_gather_into_tensor
        xs = _inputs(seed + 3, world, (3, 2), dtype)
        out = torch.full((world * 3, 2), float("nan"), dtype=dtype)
        comm.all_gather_into_tensor(out, xs[rank])
        _close(out, torch.cat([x.double() for x in xs]), f"all_gather_into_tensor {dtype}", dtype)

        # broadcast from the last rank
        xs = _inputs(seed + 4, world, (7,), dtype)
        t = xs[rank].clone()
        comm.broadcast(t, src=world - 1)
        _close(t, xs[world - 1].double(), f"broadcast {dtype}", dtype)
        checked += ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast"]

    # all_to_all_single with uneven splits, some zero: rank r sends splits[r][p] rows to p
    g = torch.Generator().manual_seed(seed + 5)
    splits = torch.randint(0, 4, (world, world), generator=g)
    splits[0, world - 1] = 0
    splits[world - 1, 0] = 0
    rows = [torch.randn(int(splits[r].sum()), 2, generator=g, dtype=torch.float64) for r in range(world)]
    in_splits = splits[rank].tolist()
    out_splits = splits[:, rank].tolist()
    out = torch.full((sum(out_splits), 2), float("nan"), dtype=torch.float64)
    comm.all_to_all_single(out, rows[rank], out_splits, in_splits)
    expected = torch.cat([torch.split(rows[p], splits[p].tolist())[rank] for p in range(world)])
    _close(out, expected, "all_to_all_single uneven", torch.float64)
    # even split (no split sizes)
    xs = _inputs(seed + 6, world, (world * 2, 3), torch.float64)
    out = torch.empty_like(xs[rank])
    comm.all_to_all_single(out, xs[rank])
    _close(out, torch.cat([x[rank * 2:(rank + 1) * 2] for x in xs]), "all_to_all_single even", torch.float64)
    checked.append("all_to_all_single")

    # sub-group: even ranks only
    evens = list(range(0, world, 2))
    group = comm.new_group(evens)
    if rank in evens:
        xs = _inputs(seed + 7, world, (4,), torch.float64)
        t = xs[rank].clone()
        comm.all_reduce(t, group=group)
        _close(t, sum(xs[r] for r in evens), "all_reduce on new_group", torch.float64)
        assert comm.get_world_size(group) == len(evens)
        assert comm.get_rank(group) == evens.index(rank)
    comm.barrier()
    checked += ["new_group", "barrier"]
    return {"rank": comm.get_rank(), "world": comm.get_world_size(), "checked": sorted(set(checked))}


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_float64_reference(world):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    results = run_ranks(check_all_collectives, world, seed, timeout=90)
    assert [r["rank"] for r in results] == list(range(world))
    assert all(r["world"] == world for r in results)
    assert results[0]["checked"] == sorted({"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
                                            "broadcast", "all_to_all_single", "new_group", "barrier"})
