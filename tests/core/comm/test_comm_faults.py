"""Faults end in clear errors, never hangs: a silent peer times out, a dead peer is reported."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
from polyaccel import comm
from polyaccel.testing.multiprocess import RankFailure, run_ranks

pytestmark = pytest.mark.timeout(120)


def _store():
    return dist.distributed_c10d._get_default_store()


def irecv_from_silent_peer(rank: int, world: int) -> dict:
    """Rank 0 waits for a message rank 1 never sends (the timeout comes from POLYACCEL_COMM_TIMEOUT)."""
    store = _store()
    facts = {"timeout_s": comm.get_timeout().total_seconds()}
    if rank == 0:
        handle = comm.irecv(torch.empty(3), src=1, tag=11)
        start = time.monotonic()
        try:
            handle.wait()
        except comm.CommTimeoutError as exc:
            facts.update(elapsed=time.monotonic() - start, message=str(exc), is_timeout=isinstance(exc, TimeoutError),
                         op=exc.op)
        store.set("done", "1")
    else:
        store.wait(["done"], datetime.timedelta(seconds=60))  # stay alive, send nothing
    return facts


def all_reduce_without_peer(rank: int, world: int) -> dict:
    """Rank 0 enters an all_reduce that rank 1 never joins (the timeout comes from the argument),
    first on a sub-group (which must inherit the timeout, not torch's default), then on the world."""
    store = _store()
    facts = {"timeout_s": comm.get_timeout().total_seconds()}
    pair = comm.new_group([0, 1])
    if rank == 0:
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(4), group=pair)
        except comm.CommTimeoutError:
            facts["subgroup_elapsed"] = time.monotonic() - start
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(4))
        except comm.CommTimeoutError as exc:
            facts.update(elapsed=time.monotonic() - start, message=str(exc), op=exc.op)
        store.set("done", "1")
    else:
        store.wait(["done"], datetime.timedelta(seconds=60))
    return facts


def one_rank_exits(rank: int, world: int, victim: int) -> None:
    comm.barrier()
    if rank == victim:
        os._exit(3)
    for _ in range(1000):  # the survivors keep communicating; each call must fail, not hang
        comm.all_reduce(torch.ones(8))


def test_a_peer_that_never_sends_times_out_clearly_env_configured():
    results = run_ranks(irecv_from_silent_peer, 2, timeout=60, env={"POLYACCEL_COMM_TIMEOUT": "2"})
    r0 = results[0]
    assert r0["timeout_s"] == 2.0 and results[1]["timeout_s"] == 2.0
    assert "message" in r0, "the receive did not time out"
    assert 1.5 <= r0["elapsed"] < 15
    assert r0["is_timeout"] and r0["op"] == "irecv"
    assert "timed out after 2 s" in r0["message"] and "POLYACCEL_COMM_TIMEOUT" in r0["message"]


def test_a_collective_a_peer_never_joins_times_out_argument_beats_env():
    results = run_ranks(all_reduce_without_peer, 2, timeout=60, comm_timeout=1.5,
                        env={"POLYACCEL_COMM_TIMEOUT": "999"})
    r0 = results[0]
    assert r0["timeout_s"] == 1.5
    assert "message" in r0, "the all_reduce did not time out"
    assert 1.0 <= r0["elapsed"] < 15
    assert r0["op"] == "all_reduce" and "init_distributed(timeout=" in r0["message"]
    assert "subgroup_elapsed" in r0, "the sub-group all_reduce did not time out"
    assert 1.0 <= r0["subgroup_elapsed"] < 15, "new_group did not inherit the layer's timeout"


@pytest.mark.parametrize("world,victim", [(2, 1), (4, 2)])
def test_a_rank_that_exits_makes_the_others_fail_clearly_without_hanging(world, victim):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(one_rank_exits, world, victim, timeout=60, comm_timeout=60)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == victim and err.exc_type == "RankDied"
    assert "exited with code 3" in str(err)
    survivors = {r: o.exc_type for r, o in err.failures.items() if r != victim}
    assert survivors, "no survivor reported an error"
    assert set(survivors.values()) == {"PeerLostError"}, survivors
    assert "a peer closed its connection" in err.failures[min(survivors)].message
    # far below the 60 s collective timeout: the loss is detected, not waited out
    assert elapsed < 30
