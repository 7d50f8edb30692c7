"""The multi-process runner: results per rank, the failing rank's traceback, hung ranks killed."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
from polyaccel import comm
from polyaccel.testing.multiprocess import RankFailure, RanksTimeout, run_ranks

pytestmark = pytest.mark.timeout(120)


def _child_exit(code):
    os._exit(code)


def report_identity(rank, world, token):
    # a rank may start processes of its own (data-loader workers, say)
    child = multiprocessing.get_context("fork").Process(target=_child_exit, args=(7,))
    child.start()
    child.join(30)
    return {"rank": rank, "world": world, "token": token, "pid": os.getpid(), "env_rank": os.environ["RANK"],
            "initialized": comm.is_initialized(), "extra": os.environ.get("POLYACCEL_TEST_EXTRA"),
            "child_exit": child.exitcode}


def fail_on_one(rank, world):
    if rank == 1:
        raise KeyError(f"deliberate failure on rank {rank}")
    comm.barrier()  # rank 0 waits here until rank 1's failure tears its group down
    return rank


def hang_on_zero(rank, world):
    if rank == 0:
        time.sleep(600)
    return rank


def test_results_by_rank_in_separate_initialised_processes(monkeypatch):
    monkeypatch.setenv("POLYACCEL_TEST_EXTRA", "from-parent")
    out = run_ranks(report_identity, 3, "tok", timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert [o["env_rank"] for o in out] == ["0", "1", "2"]
    assert all(o["world"] == 3 and o["token"] == "tok" and o["initialized"] for o in out)
    assert all(o["extra"] == "from-parent" for o in out), "the ranks must see the parent's environment at call time"
    assert len({o["pid"] for o in out} | {os.getpid()}) == 4
    assert [o["child_exit"] for o in out] == [7, 7, 7]


def test_failing_rank_is_reported_with_its_traceback_and_peers_do_not_hang():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(fail_on_one, 2, timeout=60)
    err = info.value
    assert err.rank == 1 and err.exc_type == "KeyError"
    assert "deliberate failure on rank 1" in str(err)
    assert "in fail_on_one" in err.remote_traceback and "raise KeyError" in err.remote_traceback
    assert isinstance(err.__cause__, KeyError)
    assert time.monotonic() - start < 30


def test_hung_rank_is_killed_at_the_timeout_with_its_stack():
    start = time.monotonic()
    with pytest.raises(RanksTimeout) as info:
        run_ranks(hang_on_zero, 2, timeout=6)
    elapsed = time.monotonic() - start
    assert elapsed < 20
    assert "rank(s) [0]" in str(info.value)
    assert "hang_on_zero" in str(info.value), "the hung rank's stack should be in the error"


def test_local_functions_are_refused_with_a_fix():
    def local(rank, world):
        return rank

    with pytest.raises(ValueError, match="module-level function"):
        run_ranks(local, 2)


def return_unpicklable(rank, world):
    return (lambda: rank) if rank == 1 else rank


def test_an_unpicklable_result_is_a_clear_error():
    with pytest.raises(RankFailure, match="the value rank 1 returned cannot be pickled back") as info:
        run_ranks(return_unpicklable, 2, timeout=60)
    assert info.value.rank == 1
