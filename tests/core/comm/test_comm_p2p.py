"""isend/irecv are truly non-blocking, complete only when the peer sends, and keep tag order.

The ranks coordinate through the rendezvous store (outside the process group), so a receive
that blocked until its data arrived would deadlock the run: rank 1 sends only after rank 0
says its receive was posted and seen incomplete.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from polyaccel import comm
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(120)


def _store():
    return dist.distributed_c10d._get_default_store()


def _payloads(seed: int, n: int = 5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, generator=g, dtype=torch.float64) for _ in range(n)]


def check_nonblocking_p2p(rank: int, world: int, seed: int) -> dict:
    store = _store()
    data = _payloads(seed)
    facts = {}
    # 1. an irecv posted before its peer sends returns at once and stays incomplete
    if rank == 0:
        buf = torch.full((6,), float("nan"), dtype=torch.float64)
        handle = comm.irecv(buf, src=1, tag=3)
        assert isinstance(handle, comm.CommHandle)
        time.sleep(0.2)
        facts["incomplete_before_send"] = not handle.is_completed()
        facts["untouched_before_send"] = bool(torch.isnan(buf).all())
        store.set("posted", "1")
        handle.wait()
        torch.testing.assert_close(buf, data[0], rtol=0, atol=0)
        facts["is_completed_after_wait"] = handle.is_completed()
    elif rank == 1:
        store.wait(["posted"])
        handle = comm.isend(data[0].clone(), dst=0, tag=3)
        assert isinstance(handle, comm.CommHandle)
        handle.wait()

    # 2. tags: the receiver posts tag 1 then tag 2, the sender sends tag 2 first; each gets its own
    #    message; same-tag messages arrive in the order they were sent
    if rank == 0:
        a, b = torch.empty(6, dtype=torch.float64), torch.empty(6, dtype=torch.float64)
        c, d = torch.empty(6, dtype=torch.float64), torch.empty(6, dtype=torch.float64)
        handles = [comm.irecv(a, src=1, tag=1), comm.irecv(b, src=1, tag=2),
                   comm.irecv(c, src=1, tag=5), comm.irecv(d, src=1, tag=5)]
        store.set("tags-posted", "1")
        comm.wait_all(handles)
        for got, want in ((a, data[1]), (b, data[2]), (c, data[3]), (d, data[4])):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        facts["tag_order"] = True
    elif rank == 1:
        store.wait(["tags-posted"])
        handles = [comm.isend(data[2], dst=0, tag=2), comm.isend(data[1], dst=0, tag=1),
                   comm.isend(data[3], dst=0, tag=5), comm.isend(data[4], dst=0, tag=5)]
        comm.wait_all(handles)

    # 3. blocking send/recv and a batched ring exchange over every rank
    if rank == 0:
        comm.send(data[0] * 2, dst=world - 1, tag=9)
    if rank == world - 1:
        buf = torch.empty(6, dtype=torch.float64)
        assert comm.recv(buf, src=0, tag=9) == 0
        torch.testing.assert_close(buf, data[0] * 2, rtol=0, atol=0)
    mine = data[0] + rank
    got = torch.empty_like(mine)
    ops = [comm.P2POp(comm.isend, mine, (rank + 1) % world), comm.P2POp(comm.irecv, got, (rank - 1) % world)]
    comm.wait_all(comm.batch_isend_irecv(ops))
    torch.testing.assert_close(got, data[0] + (rank - 1) % world, rtol=0, atol=0)
    comm.barrier()
    return facts


@pytest.mark.parametrize("world", [2, 4])
def test_isend_irecv_are_nonblocking_ordered_and_correct(world):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    results = run_ranks(check_nonblocking_p2p, world, seed, timeout=60, comm_timeout=30)
    assert results[0] == {"incomplete_before_send": True, "untouched_before_send": True,
                          "is_completed_after_wait": True, "tag_order": True}
