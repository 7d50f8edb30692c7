"""The polyaccel_collective wrapper hook and CommTracer: schedules, groups, bytes; free when unused."""

from __future__ import annotations

import pytest
import torch
from polyaccel import comm, hookimpl, selection
from polyaccel.comm.tracing import CommTracer
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(120)


class CountingWrapper:
    """A third party's profiler: counts calls per op and sees each call's result."""

    def __init__(self):
        self.calls = {}

    @hookimpl(wrapper=True)
    def polyaccel_collective(self, op, call):
        assert callable(call)
        result = yield
        self.calls[op] = self.calls.get(op, 0) + 1
        return result


def traced_schedule(rank: int, world: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    facts = {"direct_before": comm.dispatch.direct}
    pair = comm.new_group([0, 1])
    with CommTracer() as tracer:
        facts["direct_inside"] = comm.dispatch.direct
        t = torch.randn(4, 3, generator=g)  # 48 bytes
        comm.all_reduce(t)
        gathered = torch.empty(world * 4, 3)
        comm.all_gather_into_tensor(gathered, t)
        if rank in (0, 1):
            comm.all_reduce(torch.randn(2, generator=g, dtype=torch.float64), group=pair)
        handle = comm.all_reduce(t, async_op=True)
        assert isinstance(handle, comm.CommHandle)
        handle.wait()
        got = torch.empty(5, dtype=torch.float64)
        reqs = [comm.isend(torch.randn(5, generator=g, dtype=torch.float64), dst=(rank + 1) % world),
                comm.irecv(got, src=(rank - 1) % world)]
        comm.wait_all(reqs)
        try:
            comm.broadcast(t, src=world + 7)  # no such rank: the failed call is traced too
        except (ValueError, RuntimeError):
            pass
        comm.barrier()
    facts["direct_after"] = comm.dispatch.direct
    comm.all_reduce(torch.ones(1))  # after the tracer left: not recorded
    facts["events"] = [(e.op, list(e.group_ranks), e.bytes, e.async_op, e.ok, e.dtypes) for e in tracer.events]
    facts["durations_ok"] = all(e.duration_s >= 0 for e in tracer.events)
    facts["all_reduce_bytes"] = tracer.total_bytes("all_reduce")

    # a plugin's own wrapper, registered after init: active once refresh() is called
    counter = CountingWrapper()
    pm = selection.plugins().pm
    pm.register(counter, name="counting-wrapper")
    comm.refresh()
    comm.all_reduce(torch.ones(2))
    comm.barrier()
    pm.unregister(counter)
    comm.refresh()
    comm.all_reduce(torch.ones(2))
    facts["counted"] = counter.calls
    facts["direct_at_end"] = comm.dispatch.direct
    return facts


def test_tracer_records_the_schedule_groups_and_bytes():
    world = 4
    results = run_ranks(traced_schedule, world, 123, timeout=60)
    everyone = list(range(world))
    for rank, facts in enumerate(results):
        assert facts["direct_before"] is True and facts["direct_inside"] is False
        assert facts["direct_after"] is True and facts["direct_at_end"] is True
        expected = [("all_reduce", everyone, 48, False, True, ("float32",)),
                    ("all_gather_into_tensor", everyone, 48, False, True, ("float32",))]
        if rank in (0, 1):
            expected.append(("all_reduce", [0, 1], 16, False, True, ("float64",)))
        expected += [("all_reduce", everyone, 48, True, True, ("float32",)),
                     ("isend", everyone, 40, True, True, ("float64",)),
                     ("irecv", everyone, 40, True, True, ("float64",)),
                     ("broadcast", everyone, 48, False, False, ("float32",)),
                     ("barrier", everyone, 0, False, True, ())]
        assert [tuple(e) for e in facts["events"]] == expected, f"rank {rank}"
        assert facts["durations_ok"]
        assert facts["all_reduce_bytes"] == (48 * 2 + (16 if rank in (0, 1) else 0))
        assert facts["counted"] == {"all_reduce": 1, "barrier": 1}


def test_untraced_layer_does_not_touch_pluggy(monkeypatch):
    """Without a wrapper the dispatch flag stays on: no hook caller is consulted per call."""
    comm.refresh()
    assert comm.dispatch.direct is True and comm.dispatch.hook_caller is None
    with CommTracer():
        assert comm.dispatch.direct is False and comm.dispatch.hook_caller is not None
    assert comm.dispatch.direct is True and comm.dispatch.hook_caller is None
