"""What each of the two ranks runs for the comm rows (module level: run_ranks pickles by name).

:func:`all_checks` runs every check on the rank's device and returns
``{check: (ok, message)}``; a failing check never stops the others, so one run of
two processes yields every comm row.
"""

from __future__ import annotations

import time
import traceback

import torch

#: check name -> capability it belongs to (None: the comm contract itself)
CHECKS = {
    "all_reduce": None, "broadcast": None, "all_gather_into_tensor": None, "reduce_scatter_tensor": None,
    "all_to_all_single_uneven": None, "barrier": None, "isend_irecv": "async_p2p",
}
#: how long the sender waits before sending, and how fast an irecv must return to count as non-blocking
SEND_DELAY_S = 1.0
NONBLOCKING_LIMIT_S = 0.5


def _data(rank: int, n: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(n, generator=g, dtype=torch.float64).float()


def _device(acc, rank: int):
    return acc.device(rank) if acc.device_count() > 1 else acc.device()


def _all_reduce(comm, acc, dev, rank, world):
    t = _data(rank, 37, 1).to(dev)
    comm.all_reduce(t)
    want = sum(_data(r, 37, 1).double() for r in range(world))
    torch.testing.assert_close(t.cpu().double(), want, rtol=1e-5, atol=1e-5)


def _broadcast(comm, acc, dev, rank, world):
    t = _data(rank, 29, 2).to(dev)
    comm.broadcast(t, src=1)
    assert torch.equal(t.cpu(), _data(1, 29, 2)), "broadcast from rank 1 delivered other data"


def _all_gather(comm, acc, dev, rank, world):
    out = torch.empty(world * 13, device=dev)
    comm.all_gather_into_tensor(out, _data(rank, 13, 3).to(dev))
    want = torch.cat([_data(r, 13, 3) for r in range(world)])
    assert torch.equal(out.cpu(), want), "all_gather_into_tensor assembled the wrong tensor"


def _reduce_scatter(comm, acc, dev, rank, world):
    out = torch.empty(11, device=dev)
    comm.reduce_scatter_tensor(out, _data(rank, 11 * world, 4).to(dev))
    total = sum(_data(r, 11 * world, 4).double() for r in range(world))
    torch.testing.assert_close(out.cpu().double(), total[rank * 11:(rank + 1) * 11], rtol=1e-5, atol=1e-5)


def _all_to_all(comm, acc, dev, rank, world):
    # rank r sends (r + d + 1) % 3 rows to rank d: uneven, some zero
    def splits(src):
        return [(src + d + 1) % 3 for d in range(world)]

    send = _data(rank, sum(splits(rank)), 5).to(dev)
    in_splits = [splits(s)[rank] for s in range(world)]
    out = torch.empty(sum(in_splits), device=dev)
    comm.all_to_all_single(out, send, output_split_sizes=in_splits, input_split_sizes=splits(rank))
    pieces = []
    for s in range(world):
        offs = sum(splits(s)[:rank])
        pieces.append(_data(s, sum(splits(s)), 5)[offs:offs + splits(s)[rank]])
    assert torch.equal(out.cpu(), torch.cat(pieces)), "all_to_all_single with uneven splits misrouted rows"


def _barrier(comm, acc, dev, rank, world):
    comm.barrier()


def _isend_irecv(comm, acc, dev, rank, world):
    """Rank 1 posts irecv before rank 0 sends: it must return at once and complete only later."""
    if rank == 0:
        time.sleep(SEND_DELAY_S)
        handle = comm.isend(_data(0, 41, 6).to(dev), dst=1, tag=7)
        handle.wait()
        return ""
    buf = torch.zeros(41, device=dev)
    t0 = time.monotonic()
    handle = comm.irecv(buf, src=0, tag=7)
    posted = time.monotonic() - t0
    early_done = handle.is_completed()
    handle.wait()
    assert torch.equal(buf.cpu(), _data(0, 41, 6)), "irecv received other data than was sent"
    blocking = posted > NONBLOCKING_LIMIT_S or early_done
    if acc.has("async_p2p") and blocking:
        raise AssertionError(f"'async_p2p' is claimed but irecv blocked: it returned after {posted:.2f} s "
                             f"(peer sends after {SEND_DELAY_S} s), completed early: {early_done}")
    return "non-blocking" if not blocking else "blocking (allowed: 'async_p2p' is not claimed)"


_FUNCS = {
    "all_reduce": _all_reduce, "broadcast": _broadcast, "all_gather_into_tensor": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter, "all_to_all_single_uneven": _all_to_all, "barrier": _barrier,
    "isend_irecv": _isend_irecv,
}


def all_checks(rank: int, world_size: int) -> dict[str, tuple[bool, str]]:
    import polyaccel
    from polyaccel import comm

    acc = polyaccel.get_accelerator()
    dev = _device(acc, rank)
    out: dict[str, tuple[bool, str]] = {}
    for name, fn in _FUNCS.items():
        try:
            note = fn(comm, acc, dev, rank, world_size)
            out[name] = (True, note or "")
        except Exception as exc:  # noqa: BLE001 - reported as this check's FAIL row
            out[name] = (False, f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")
        comm.barrier()  # keep both ranks on the same check
    return out
