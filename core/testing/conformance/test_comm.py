"""Collectives and p2p over two ranks through ``polyaccel.comm`` on the accelerator's devices.

Runs when the accelerator's communication backend can run two ranks on this machine
(the backend is built into torch, and there are two devices or the device is the host).
The ranks are new processes: an emulated runtime, which lives in this process only,
cannot be seen by them, so emulated runs skip these rows.
"""

from __future__ import annotations

import pytest
from polyaccel.testing.conformance import comm_cases
from polyaccel.testing.conformance.checks import claim

WORLD = 2
TIMEOUT_S = 120.0


def _why_not(target) -> str:
    import torch.distributed as dist
    from polyaccel.comm import resolve_hooks

    acc = target.accelerator
    if target.emulated:
        return "the accelerator is emulated in this process only; new rank processes cannot see the emulated runtime"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    backend = resolve_hooks(acc).backend
    if not dist.is_backend_available(backend):
        return f"torch.distributed backend {backend!r} is not available in this torch build"
    if acc.device_type != "cpu" and acc.device_count() < WORLD:
        return f"needs {WORLD} {acc.device_type} devices, this machine has {acc.device_count()}"
    return ""


@pytest.fixture(scope="module")
def rank_results(conformance_target):
    reason = _why_not(conformance_target)
    if reason:
        pytest.skip(reason)
    from polyaccel.comm import resolve_hooks
    from polyaccel.testing.multiprocess import run_ranks

    acc = conformance_target.accelerator
    return run_ranks(comm_cases.all_checks, WORLD, timeout=TIMEOUT_S, backend=resolve_hooks(acc).backend,
                     env={"POLYACCEL_ACCELERATOR": acc.name})


@pytest.mark.parametrize("check", [
    pytest.param(name, marks=pytest.mark.conformance(area="comm", subject=cap or "collectives", check=name))
    for name, cap in comm_cases.CHECKS.items()])
def test_comm(conformance_target, conformance_row, rank_results, check):
    cap = comm_cases.CHECKS[check]
    if cap is not None:
        claim(conformance_target, conformance_row, cap)
    notes = []
    for rank, res in enumerate(rank_results):
        ok, message = res[check]
        if not ok:
            pytest.fail(message.splitlines()[0] + "\n" + message)
        if message:
            notes.append(f"rank {rank}: {message}")
    if notes:
        conformance_row.note("; ".join(notes))
