"""A process group polyaccel created is destroyed once on every way out; one the application made is left alone.

Each case is a real process (``teardown_rank.py``) started the way ``torchrun`` starts a rank (MASTER_ADDR/PORT,
RANK, WORLD_SIZE), on gloo; all cases run at once.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from polyaccel.comm import teardown

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).with_name("teardown_rank.py")
#: mode -> world size
CASES = {"normal": 2, "raise": 2, "user-group": 2, "destroy-then-exit": 1, "user-handler": 1,
         "sigterm": 1, "sigint": 1, "sigint-twice": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, world: int) -> list[subprocess.Popen]:
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank), POLYACCEL_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), mode], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[tuple[int, str, str]]]:
    """mode -> per rank (return code, stdout, stderr)."""
    running = {mode: _launch(mode, world) for mode, world in CASES.items()}
    done = {}
    try:
        for mode, procs in running.items():
            outputs = [p.communicate(timeout=90) for p in procs]
            done[mode] = [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]
    finally:
        for procs in running.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
    return done


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def _clean_exit_hooks(err: str) -> None:
    assert "Exception ignored in atexit" not in err and "Error in atexit" not in err, err
    assert "destroy_process_group" not in err, err  # torch's warning about a group left alive at exit


def test_normal_exit_destroys_once(outcomes):
    for rc, out, err in outcomes["normal"]:
        assert rc == 0, err
        assert out.splitlines() == ["reduced", "destroy-called", "alive-at-end False"], (out, err)
        assert "Traceback" not in err and "polyaccel:" not in err, err
        _clean_exit_hooks(err)


def test_exception_exit_destroys_once_and_keeps_the_users_traceback(outcomes):
    (rc0, out0, err0), (rc1, out1, err1) = outcomes["raise"]
    assert rc0 == 0, err0
    assert rc1 == 1, err1
    assert err1.count("Traceback") == 1 and "ValueError: the user's own error" in err1, err1
    for out, err in ((out0, err0), (out1, err1)):
        assert out.splitlines() == ["reduced", "destroy-called", "alive-at-end False"], (out, err)
        _clean_exit_hooks(err)


def test_a_group_the_user_created_is_left_alone(outcomes):
    for rc, out, err in outcomes["user-group"]:
        assert rc == 0, err
        assert out.splitlines() == ["reduced", "alive-at-end True"], (out, err)
        _clean_exit_hooks(err)


def test_explicit_destroy_is_the_only_one(outcomes):
    [(rc, out, err)] = outcomes["destroy-then-exit"]
    assert rc == 0, err
    assert out.splitlines() == ["reduced", "destroy-called", "alive-at-end False"], (out, err)
    _clean_exit_hooks(err)


def test_the_applications_own_signal_handler_is_kept(outcomes):
    [(rc, out, err)] = outcomes["user-handler"]
    assert rc == 0, err
    assert out.splitlines() == ["handler kept True", "reduced", "destroy-called", "alive-at-end False"], (out, err)


def test_sigterm_destroys_then_dies_by_sigterm(outcomes):
    [(rc, out, err)] = outcomes["sigterm"]
    assert rc == -signal.SIGTERM, (rc, err)
    assert out.splitlines() == ["reduced", "destroy-called"], (out, err)  # no exit hooks after a signal death
    assert _lines(err, "polyaccel:") == ["polyaccel: rank 0: SIGTERM: process group destroyed, exiting"], err
    assert "Traceback" not in err, err


def test_ctrl_c_is_one_line_then_destroy_at_exit_and_death_by_sigint(outcomes):
    [(rc, out, err)] = outcomes["sigint"]
    assert rc == -signal.SIGINT, (rc, err)
    assert out.splitlines() == ["reduced", "destroy-called", "alive-at-end False"], (out, err)
    [line] = _lines(err, "polyaccel:")
    assert re.fullmatch(r"polyaccel: rank 0: interrupted \(KeyboardInterrupt\) in <module> \(teardown_rank\.py:\d+\); "
                        "exiting", line), err
    assert "Traceback" not in err, err
    _clean_exit_hooks(err)


def test_a_second_ctrl_c_while_exiting_is_one_line_not_a_traceback(outcomes):
    [(rc, out, err)] = outcomes["sigint-twice"]
    assert rc == -signal.SIGINT, (rc, err)
    assert out.splitlines() == ["reduced", "destroy-called", "alive-at-end False"], (out, err)
    assert _lines(err, "polyaccel:")[-1] == "polyaccel: rank 0: interrupted again while exiting; exiting now", err
    assert "Traceback" not in err, err


def test_a_failing_teardown_is_one_line_never_an_exception(monkeypatch, capsys):
    group = object()
    monkeypatch.setattr(teardown, "_group", group)
    monkeypatch.setattr(teardown, "_default_group", lambda: group)
    monkeypatch.setattr(teardown, "_end_session", lambda: None)

    def broken():
        raise RuntimeError("the backend refused")

    monkeypatch.setattr(teardown.dist, "destroy_process_group", broken)
    monkeypatch.setenv("RANK", "3")
    assert teardown.teardown("at exit") is False
    assert teardown._group is None
    err = capsys.readouterr().err
    assert err == ("polyaccel: rank 3: destroying the process group (at exit) failed: "
                   "RuntimeError: the backend refused\n")
    assert teardown.teardown("at exit") is False  # once: nothing left to destroy, nothing said
    assert capsys.readouterr().err == ""


def test_release_signals_leaves_them_to_the_framework_and_keeps_the_exit_teardown(monkeypatch):
    """What PolyaccelStrategy does after init: Lightning's own SIGTERM handling stays; the group still goes at exit."""
    import signal as sig

    group = object()
    monkeypatch.setattr(teardown, "_default_group", lambda: group)
    before = {s: sig.getsignal(s) for s in (sig.SIGTERM, sig.SIGINT)}
    try:
        teardown.arm()
        armed = sig.getsignal(sig.SIGTERM)
        teardown.release_signals()
        assert {s: sig.getsignal(s) for s in before} == before
        assert teardown._group is group  # still owned: the exit hook destroys it
    finally:
        monkeypatch.setattr(teardown, "_group", None)
        teardown.disarm()
    # armed over the default handler only (an application's own is left alone)
    assert armed is (teardown._on_sigterm if before[sig.SIGTERM] is sig.SIG_DFL else before[sig.SIGTERM])

