"""A rank killed by gloo mid-collective: the survivor's error names it and the runner shows its stderr."""

from __future__ import annotations

import pytest
import torch
from polyaccel.testing.multiprocess import RankFailure, run_ranks


def mismatched_all_reduce(rank: int, world_size: int) -> None:
    from polyaccel import comm

    comm.all_reduce(torch.ones(4 if rank == 0 else 100))


def test_a_rank_aborted_by_a_size_mismatch_is_named_with_its_last_words():
    with pytest.raises(RankFailure) as info:
        run_ranks(mismatched_all_reduce, 2, timeout=60, comm_timeout=30)
    err = info.value
    died = [r for r, o in err.failures.items() if o.exc_type == "RankDied"]
    assert len(died) == 1, str(err)
    dead = died[0]
    assert err.rank == dead, str(err)
    assert "Received data size doesn't match" in str(err), str(err)  # the aborted rank's stderr
    survivor = err.failures[1 - dead]
    assert survivor.exc_type == "PeerLostError", survivor.message
    assert f"rank {dead} (pid " in survivor.message and "no longer running" in survivor.message, survivor.message
