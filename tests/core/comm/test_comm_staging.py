"""Host staging semantics, on CPU tensors with a staged comm-hooks configuration (the path mps uses).

- results reach the caller's tensor only in ``wait()``, after the transfer completed;
- send-only tensors (isend/send payloads, a broadcast's source) are never copied back;
- staging buffers come from the accelerator (``empty_pinned``) and are reused across calls;
- staged collectives give the same results as the float64 reference.
"""

from __future__ import annotations

import time

import polyaccel
import pytest
import torch
import torch.distributed as dist
from polyaccel import comm
from polyaccel.comm import CommHooks
from polyaccel.comm.staging import IN, INOUT, OUT, StagingPool, run_staged
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(120)

STAGED = CommHooks(backend="gloo", supports_device_tensors=False)


def _count_accelerator_allocations():
    """Count host-buffer allocations the staging pool asks the accelerator for."""
    accelerator = polyaccel.get_accelerator()
    calls = []
    original = accelerator.empty_pinned

    def counting(shape, dtype):
        calls.append((tuple(shape), dtype))
        return original(shape, dtype)

    accelerator.empty_pinned = counting
    return calls


def _delta(stats, before):
    now = stats.as_dict()
    return {k: now[k] - before[k] for k in now}


def _round_of_collectives(rank, world, g):
    """One training-step-like round of staged calls; returns per-op copy-back counts."""
    stats = comm.staging_stats()
    counts = {}
    xs = [torch.randn(8, 3, generator=g, dtype=torch.float64) for _ in range(world)]

    before = stats.as_dict()
    t = xs[rank].clone()
    comm.all_reduce(t)
    torch.testing.assert_close(t, sum(xs), rtol=1e-12, atol=1e-12)
    counts["all_reduce"] = _delta(stats, before)["copies_back"]

    before = stats.as_dict()
    t = xs[rank].clone()
    comm.broadcast(t, src=0)
    torch.testing.assert_close(t, xs[0], rtol=0, atol=0)
    counts["broadcast_src" if rank == 0 else "broadcast_dst"] = _delta(stats, before)["copies_back"]

    before = stats.as_dict()
    big = [torch.randn(world * 2, 3, generator=g, dtype=torch.float64) for _ in range(world)]
    out = torch.full((2, 3), float("nan"), dtype=torch.float64)
    comm.reduce_scatter_tensor(out, big[rank])
    torch.testing.assert_close(out, sum(big)[rank * 2:(rank + 1) * 2], rtol=1e-12, atol=1e-12)
    d = _delta(stats, before)
    counts["reduce_scatter_tensor"] = (d["copies_in"], d["copies_back"])

    gathered = torch.full((world * 8, 3), float("nan"), dtype=torch.float64)
    comm.all_gather_into_tensor(gathered, xs[rank])
    torch.testing.assert_close(gathered, torch.cat(xs), rtol=0, atol=0)

    out = torch.empty(world * 2, 3, dtype=torch.float64)
    comm.all_to_all_single(out, big[rank])
    torch.testing.assert_close(out, torch.cat([b[rank * 2:(rank + 1) * 2] for b in big]), rtol=0, atol=0)

    before = stats.as_dict()
    mine = xs[rank].clone()
    got = torch.empty_like(mine)
    handles = comm.batch_isend_irecv([comm.P2POp(comm.isend, mine, (rank + 1) % world),
                                      comm.P2POp(comm.irecv, got, (rank - 1) % world)])
    comm.wait_all(handles)
    torch.testing.assert_close(got, xs[(rank - 1) % world], rtol=0, atol=0)
    torch.testing.assert_close(mine, xs[rank], rtol=0, atol=0)
    counts["batch_isend_irecv"] = _delta(stats, before)["copies_back"]
    return counts


def check_staging(rank: int, world: int, seed: int) -> dict:
    allocations = _count_accelerator_allocations()
    comm.set_hooks(STAGED)
    stats = comm.staging_stats()
    store = dist.distributed_c10d._get_default_store()
    g = torch.Generator().manual_seed(seed)
    payload = torch.randn(16, generator=g, dtype=torch.float64)
    facts: dict = {}

    # 1. a staged irecv: nothing lands in the caller's tensor until wait(), even after the data arrived
    if rank == 0:
        buf = torch.full((16,), float("nan"), dtype=torch.float64)
        before = stats.as_dict()
        handle = comm.irecv(buf, src=1, tag=4)
        store.set("posted", "1")
        store.wait(["sent"])  # the sender's wait() returned: the data has left rank 1
        time.sleep(0.2)
        facts["untouched_after_transfer_before_wait"] = bool(torch.isnan(buf).all())
        facts["copies_back_before_wait"] = _delta(stats, before)["copies_back"]
        handle.wait()
        torch.testing.assert_close(buf, payload, rtol=0, atol=0)
        facts["copies_back_after_wait"] = _delta(stats, before)["copies_back"]
        handle.wait()  # a second wait copies nothing again
        facts["copies_back_after_second_wait"] = _delta(stats, before)["copies_back"]
    elif rank == 1:
        store.wait(["posted"])
        before = stats.as_dict()
        sent = payload.clone()
        handle = comm.isend(sent, dst=0, tag=4)
        handle.wait()
        store.set("sent", "1")
        d = _delta(stats, before)
        facts["send_copies"] = (d["copies_in"], d["copies_back"])
        torch.testing.assert_close(sent, payload, rtol=0, atol=0)
        comm.send(sent, dst=0, tag=6)
        facts["blocking_send_copies_back"] = _delta(stats, before)["copies_back"]
    if rank == 0:
        buf = torch.empty(16, dtype=torch.float64)
        comm.recv(buf, src=1, tag=6)
        torch.testing.assert_close(buf, payload, rtol=0, atol=0)

    # 2. an async staged all_reduce leaves the caller's tensor alone until wait()
    x = torch.randn(5, generator=g, dtype=torch.float64)
    xs = [x + r for r in range(world)]
    t = xs[rank].clone()
    handle = comm.all_reduce(t, async_op=True)
    comm.barrier()  # every rank contributed, the reduction is done on the host buffers
    time.sleep(0.1)
    facts["async_untouched_before_wait"] = bool(torch.equal(t, xs[rank]))
    handle.wait()
    torch.testing.assert_close(t, sum(xs), rtol=1e-12, atol=1e-12)

    # 3. a round of every collective; then the same round again allocates nothing new
    facts["first_round"] = _round_of_collectives(rank, world, g)
    allocated_after_first = stats.allocations
    second = _round_of_collectives(rank, world, g)
    facts["second_round_same_counts"] = second == facts["first_round"]
    facts["new_allocations_in_second_round"] = stats.allocations - allocated_after_first
    facts["reuses"] = stats.reuses
    facts["pool_allocations_match_accelerator_calls"] = stats.allocations == len(allocations)
    facts["allocations"] = stats.allocations
    comm.barrier()
    return facts


@pytest.mark.parametrize("world", [2, 4])
def test_staging_copies_back_only_in_wait_never_for_sends_and_reuses_buffers(world):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    results = run_ranks(check_staging, world, seed, timeout=90, comm_timeout=30)
    r0, r1 = results[0], results[1]
    assert r0["untouched_after_transfer_before_wait"] is True
    assert r0["copies_back_before_wait"] == 0
    assert r0["copies_back_after_wait"] == 1
    assert r0["copies_back_after_second_wait"] == 1
    assert r1["send_copies"] == (1, 0), "a send is staged in once and never copied back"
    assert r1["blocking_send_copies_back"] == 0
    for r in results:
        assert r["async_untouched_before_wait"] is True
        first = r["first_round"]
        assert first["all_reduce"] == 1
        assert first["reduce_scatter_tensor"] == (1, 1)
        assert first["batch_isend_irecv"] == 1, "only the receive of the batch is copied back"
        assert r["second_round_same_counts"] is True
        assert r["new_allocations_in_second_round"] == 0
        assert r["reuses"] > r["allocations"]
        assert r["pool_allocations_match_accelerator_calls"] is True
    assert r0["first_round"]["broadcast_src"] == 0
    assert r1["first_round"]["broadcast_dst"] == 1


class _ControlledWork:
    """A stand-in c10d Work whose completion the test decides; wait() refuses to run early."""

    def __init__(self):
        self.done = False
        self.waits = 0

    def is_completed(self):
        return self.done

    def wait(self, timeout=None):
        assert self.done, "wait() on a transfer the test has not completed"
        self.waits += 1
        return True


def test_run_staged_copies_back_once_only_in_wait_and_recycles_buffers():
    accelerator = polyaccel.get_accelerator()
    pool = StagingPool(accelerator)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    send = torch.randn(3, 4, generator=g)
    recv = torch.full((3, 4), float("nan"))
    both = torch.randn(5, generator=g, dtype=torch.float64)
    seen = {}
    work = _ControlledWork()

    def launch(tensors, async_op):
        assert async_op is True
        seen["tensors"] = tensors
        host_send, host_recv, host_both = tensors
        assert host_send is not send and torch.equal(host_send, send), "inputs are staged in"
        host_recv.copy_(torch.arange(12.0).view(3, 4))  # the "transfer" writes the host buffers
        host_both.mul_(2)
        return work

    entries = ((send, IN), (recv, OUT), (both, INOUT))
    handle = run_staged("test", entries, launch, pool=pool, needs_staging=lambda t: True, accelerator=accelerator,
                        timeout_s=None)
    original_both = both.clone()
    assert pool.stats.copies_in == 2 and pool.stats.copies_back == 0
    work.done = True
    assert handle.is_completed()
    assert torch.isnan(recv).all() and torch.equal(both, original_both), "nothing lands before wait()"
    assert pool.free_buffers() == 0
    handle.wait()
    assert torch.equal(recv, torch.arange(12.0).view(3, 4))
    assert torch.equal(both, original_both * 2)
    assert pool.stats.copies_back == 2, "the send-only tensor is never copied back"
    assert pool.free_buffers() == 3
    handle.wait()
    assert pool.stats.copies_back == 2 and work.waits == 1

    # same shapes again: every buffer comes from the pool
    work2 = _ControlledWork()
    work2.done = True
    run_staged("test", entries, lambda ts, a: work2, pool=pool, needs_staging=lambda t: True,
               accelerator=accelerator, timeout_s=None).wait()
    assert pool.stats.allocations == 3 and pool.stats.reuses == 3


def test_run_staged_returns_buffers_when_the_launch_fails():
    pool = StagingPool(polyaccel.get_accelerator())

    def launch(tensors, async_op):
        raise RuntimeError("backend refused")

    with pytest.raises(RuntimeError, match="backend refused"):
        run_staged("test", ((torch.ones(4), INOUT),), launch, pool=pool, needs_staging=lambda t: True,
                   accelerator=polyaccel.get_accelerator(), timeout_s=None)
    assert pool.free_buffers() == 1 and pool.stats.copies_back == 0
