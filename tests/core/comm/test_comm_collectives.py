"""Every collective of polyaccel.comm against the same math done in one process in float64 (gloo, 2 and 4 ranks).

Each rank builds every rank's inputs from a shared seed, so it can compute the expected result
locally in float64 and compare what the collective gave it. One spawned run checks all collectives
in every comm-hooks mode: plain, emulated (the native ops disabled), staged, staged + emulated;
then the argument checks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from polyaccel import comm
from polyaccel.comm import EMULATIONS, CommHooks
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(120)


def _inputs(seed: int, world: int, shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]


def _close(actual, expected64, what, dtype=torch.float32):
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(actual.double(), expected64, rtol=tol, atol=tol * 4, msg=lambda m: f"{what}: {m}")


def _collectives(rank: int, world: int, seed: int) -> list[str]:
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
    return sorted(set(checked))


EMULATED = frozenset(EMULATIONS)
MODES = {
    "plain": None,
    "emulated": CommHooks(backend="gloo", emulated_collectives=EMULATED),
    "staged": CommHooks(backend="gloo", supports_device_tensors=False),
    "staged+emulated": CommHooks(backend="gloo", supports_device_tensors=False,
                                 emulated_collectives=EMULATED),
}


def _native_disabled(*args, **kwargs):
    raise RuntimeError("the native collective was called although the hooks declare it emulated")


def _disable_native_collectives():
    """Make the natives of the emulated collectives fail, so only a real emulation can pass."""
    saved = (comm.collectives._reduce_scatter, comm.collectives._all_gather, dist.all_to_all_single)
    comm.collectives._reduce_scatter = comm.collectives._all_gather = dist.all_to_all_single = _native_disabled
    return saved


def _restore_native_collectives(saved):
    comm.collectives._reduce_scatter, comm.collectives._all_gather, dist.all_to_all_single = saved


def _bad_arguments(rank: int, world: int) -> list[str]:
    """Each bad call raises CommArgumentError naming the argument, and sends nothing."""
    messages = []
    x = torch.randn(world * 2, 3)

    def expect(fragment, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except comm.CommArgumentError as exc:
            assert fragment in str(exc), f"{fragment!r} not in {exc}"
            assert isinstance(exc, ValueError)
            messages.append(str(exc))
            return
        raise AssertionError(f"{fn.__name__} accepted bad arguments ({fragment})")

    even = [2] * world
    expect("input_split_sizes has", comm.all_to_all_single, torch.empty_like(x), x, even, [2] * (world + 1))
    expect("output_split_sizes [", comm.all_to_all_single, torch.empty_like(x), x, [3] * world, even)
    negative = [-1, 2 * world + 1] + [0] * (world - 2)
    expect("non-negative", comm.all_to_all_single, torch.empty_like(x), x, even, negative)
    expect("not divisible", comm.all_to_all_single, torch.empty(world * 2 + 1, 3), torch.empty(world * 2 + 1, 3))
    expect("output has dtype torch.float64 but input has dtype torch.float32",
           comm.all_to_all_single, torch.empty_like(x, dtype=torch.float64), x)
    expect("all dims but the first", comm.all_to_all_single, torch.empty(world * 2, 4), x)
    expect("output_tensor has dtype torch.float64 but input_tensor has dtype torch.float32",
           comm.all_gather_into_tensor, torch.empty(world * 6, dtype=torch.float64), torch.randn(6))
    expect("output_tensor has", comm.all_gather_into_tensor, torch.empty(world * 6 + 1), torch.randn(6))
    expect("output has dtype torch.bfloat16", comm.reduce_scatter_tensor, torch.empty(2, dtype=torch.bfloat16),
           torch.randn(world * 2))
    expect("input has 5 elements", comm.reduce_scatter_tensor, torch.empty(2), torch.randn(5))
    # nothing was sent: the group still works
    t = torch.ones(2)
    comm.all_reduce(t)
    assert t.tolist() == [float(world)] * 2
    return messages


def check_all_collectives(rank: int, world: int, seed: int) -> dict:
    checked = {}
    for i, (mode, hooks) in enumerate(MODES.items()):
        comm.set_hooks(hooks)
        saved = _disable_native_collectives() if hooks is not None and hooks.emulated_collectives else None
        try:
            checked[mode] = _collectives(rank, world, seed + 100 * i)
        finally:
            if saved is not None:
                _restore_native_collectives(saved)
    staged_calls = comm.staging_stats().staged_calls
    comm.set_hooks(None)
    bad = _bad_arguments(rank, world)
    return {"rank": comm.get_rank(), "world": comm.get_world_size(), "checked": checked,
            "staged_calls": staged_calls, "bad_argument_messages": bad}


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_float64_reference(world):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    results = run_ranks(check_all_collectives, world, seed, timeout=90)
    assert [r["rank"] for r in results] == list(range(world))
    assert all(r["world"] == world for r in results)
    everything = sorted({"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
                         "all_to_all_single", "new_group", "barrier"})
    assert results[0]["checked"] == {mode: everything for mode in MODES}
    assert all(r["staged_calls"] > 20 for r in results), "the staged modes must really stage"
    assert len(results[0]["bad_argument_messages"]) == 10


def test_emulated_collective_natives_are_really_disabled_in_the_check():
    """The emulated-mode check would be vacuous if disabling the natives did not bite."""
    saved = _disable_native_collectives()
    try:
        with pytest.raises(RuntimeError, match="declare it emulated"):
            comm.collectives._reduce_scatter(torch.empty(1), torch.empty(2))
        with pytest.raises(RuntimeError, match="declare it emulated"):
            dist.all_to_all_single(torch.empty(2), torch.empty(2))
    finally:
        _restore_native_collectives(saved)
    assert comm.collectives._reduce_scatter is not _native_disabled
