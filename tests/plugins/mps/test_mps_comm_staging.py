"""mps comm over gloo with host staging, two ranks: copy back only after completion, none for sends.

Each rank enters the emulated mps runtime and switches polyaccel.comm to the hooks the mps
plugin answers with (the emulated tensors are host tensors, and the hooks stage those too),
then checks, against the staging counters and the caller's tensors, that a receive lands in
the caller's tensor only inside the handle's ``wait()``, even once the transfer underneath
has completed (the data then sits in the host staging buffer),
that sends and broadcast sources are never copied back, and that a steady loop reuses its
staging buffers.
"""

from __future__ import annotations

import pytest
import torch
from polyaccel import comm, selection
from polyaccel.comm import resolve_hooks
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(120)

N = 1031
SENTINEL = -7.0


def _complete_transfer(handle, what: str) -> None:
    """Finish the c10d work underneath a collective's handle (the result is in the host staging
    buffer now) without calling the handle's own ``wait()``, which is where the copy back belongs."""
    works = handle.works()
    assert works, f"{what}: the handle holds no c10d work"
    for work in works:
        work.wait()
    assert handle.is_completed(), f"{what}: the work finished but the handle does not say so"


def _payload(seed: int, rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed * 10 + rank))


def _staged_semantics(rank: int, world: int, seed: int) -> dict:
    from polyaccel.testing.emulation import emulate

    with emulate("mps"):
        acc = selection.get_accelerator()
        assert acc.name == "mps" and acc.is_emulated()
        previous = comm.set_hooks(resolve_hooks(acc))
        try:
            return _exchange(rank, world, seed)
        finally:
            comm.set_hooks(previous)


def _exchange(rank: int, world: int, seed: int) -> dict:
    stats = comm.staging_stats()
    out: dict = {}

    # --- p2p: rank 0 sends, rank 1 receives
    data = _payload(seed, 0)
    if rank == 0:
        before = stats.copies_back
        send = data.clone()
        h = comm.isend(send, dst=1)
        h.wait()
        comm.barrier()
        assert torch.equal(send, data), "isend changed the send buffer"
        out["isend_copies_back"] = stats.copies_back - before
    else:
        buf = torch.full((N,), SENTINEL)
        before = stats.copies_back
        h = comm.irecv(buf, src=0)
        # rank 0 enters the barrier only after its send completed, and gloo delivers the messages of
        # one peer pair in order: once the barrier returns, the payload sits in the staging buffer
        comm.barrier()
        assert bool((buf == SENTINEL).all()), "irecv wrote into the caller's tensor before wait()"
        assert stats.copies_back == before, "copy back happened before wait()"
        h.wait()
        assert torch.equal(buf, data), "irecv did not deliver the payload"
        out["irecv_copies_back"] = stats.copies_back - before
        h.wait()  # a second wait copies nothing again
        out["irecv_copies_back_after_second_wait"] = stats.copies_back - before

    # --- async all_reduce: result visible only after wait()
    mine = _payload(seed + 1, rank)
    t = mine.clone()
    before_back = stats.copies_back
    h = comm.all_reduce(t, async_op=True)
    _complete_transfer(h, "all_reduce")
    assert torch.equal(t, mine), "all_reduce result reached the caller's tensor before wait()"
    h.wait()
    expected = sum(_payload(seed + 1, r).double() for r in range(world))
    torch.testing.assert_close(t.double(), expected, rtol=1e-5, atol=1e-5)
    out["all_reduce_copies_back"] = stats.copies_back - before_back

    # --- steady state: the same shapes again allocate nothing new
    allocations = stats.allocations
    for _ in range(3):
        t = _payload(seed + 2, rank)
        comm.all_reduce(t)
    out["new_allocations_in_loop"] = stats.allocations - allocations
    out["reuses"] = stats.reuses

    # --- broadcast: the source's tensor is only read
    b = _payload(seed + 3, 0) if rank == 0 else torch.zeros(N)
    before_back = stats.copies_back
    comm.broadcast(b, src=0)
    torch.testing.assert_close(b, _payload(seed + 3, 0))
    out["broadcast_copies_back"] = stats.copies_back - before_back
    return out


def test_mps_staging_over_two_ranks():
    seed = int(torch.randint(0, 2**20, ()).item())
    r0, r1 = run_ranks(_staged_semantics, 2, seed, timeout=60.0)
    assert r0["isend_copies_back"] == 0
    assert r1["irecv_copies_back"] == 1 and r1["irecv_copies_back_after_second_wait"] == 1
    assert r0["all_reduce_copies_back"] == r1["all_reduce_copies_back"] == 1
    assert r0["new_allocations_in_loop"] == r1["new_allocations_in_loop"] == 0
    assert r0["reuses"] >= 3 and r1["reuses"] >= 3
    assert r0["broadcast_copies_back"] == 0 and r1["broadcast_copies_back"] == 1
