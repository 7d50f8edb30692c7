"""Run a function on N freshly started ranks (gloo on CPU by default) and collect what each returns.

:func:`run_ranks` is what our multi-process tests use and what plugin authors can use too::

    def check_sum(rank, world_size, n):          # module level: it is pickled by name
        t = torch.full((n,), float(rank))
        polyaccel.comm.all_reduce(t)
        return t.tolist()

    results = run_ranks(check_sum, 4, 8, timeout=60)

How it works:

- The parent hosts the rendezvous ``TCPStore`` on a port the OS picks (port 0), and the ranks
  join it as clients, the way ``torchrun``'s agent store works; no port is guessed, so runs
  in parallel test workers never collide.
- Ranks are new interpreters, never forks of the (threaded) test process: by default they
  come from a ``forkserver`` that imported torch once, so a run costs a fork, not a torch
  import per rank (``start_method="spawn"`` is available too). Each rank gets the parent's
  environment as it is at the call; variables that torch reads while being imported take
  effect from when the forkserver started (use ``start_method="spawn"`` to vary those).
- Each rank calls :func:`polyaccel.comm.init_distributed`, then ``fn(rank, world_size, *args)``,
  and always :func:`polyaccel.comm.destroy`.
- A rank that raises makes :func:`run_ranks` raise :class:`RankFailure` with that rank's
  traceback (the first failure in time is the reported one; the others are attached). The
  surviving ranks get a short grace period to finish or fail on their own, then are killed.
- After ``timeout`` seconds every rank still running is killed and :class:`RanksTimeout`
  lists them with the Python stacks they were stuck in.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_ready

from ..errors import InvalidArgument, PolyaccelError

#: what the forkserver imports once, so ranks start without importing torch again
#: (``torch.distributed.tensor`` is what the first ``torch.testing.assert_close`` would import: ~1 s a rank)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "polyaccel.comm"]
if importlib.util.find_spec("transformers") is not None:  # most multi-rank runs build Hugging Face models
    PRELOAD.append("transformers")
#: seconds the other ranks get to finish or fail on their own after one rank failed
GRACE_S = 5.0
#: exception types that are consequences of another rank failing; reported after the cause
SECONDARY_FAILURES = frozenset({"PeerLostError"})


class RankFailure(PolyaccelError):
    """A rank raised (or died). ``rank``, ``exc_type``, ``remote_traceback``; ``failures`` has every rank's."""

    def __init__(self, message: str, *, rank: int, exc_type: str, remote_traceback: str,
                 failures: dict[int, RankOutcome]):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.failures = failures


class RanksTimeout(RankFailure, TimeoutError):
    """Some ranks did not finish within the run's timeout and were killed."""


@dataclass
class RankOutcome:
    rank: int
    ok: bool
    value: object = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exception: BaseException | None = None  # the original exception, when it could be pickled back
    when: float = float("inf")  # wall time of the failure in the rank

    @property
    def secondary(self) -> bool:
        """A failure caused by another rank's failure (its connection went away)."""
        return self.exc_type in SECONDARY_FAILURES


# ------------------------------------------------------------------------------------------ child side
def _rank_main(fn, rank: int, world_size: int, args: tuple, env: dict, port: int, backend: str,
               comm_timeout, conn, dump_path: str, dump_after: float, stderr_path: str) -> None:
    # the rank's stderr goes to a file the parent reads back: a rank killed by an abort in C++
    # (gloo's size checks) leaves its last words there, not in a Python traceback
    err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(err, 2)
    os.close(err)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # join the parent's store as a client
    })
    dump = open(dump_path, "w")  # noqa: SIM115 - stays open until the process ends
    faulthandler.dump_traceback_later(dump_after, exit=False, file=dump)
    from polyaccel import comm

    message: tuple
    try:
        comm.init_distributed(backend=backend, timeout=comm_timeout)
        value = fn(rank, world_size, *args)
        try:
            message = ("ok", pickle.dumps(value))
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"the value rank {rank} returned cannot be pickled back to the parent: {exc}") from exc
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        try:
            original = pickle.dumps(exc)
            pickle.loads(original)
        except Exception:  # noqa: BLE001
            original = None
        message = ("error", type(exc).__qualname__, str(exc), traceback.format_exc(), original, time.time())
    try:
        # report before tearing down: the teardown is what makes the peers fail next
        conn.send(message)
        conn.close()
    finally:
        faulthandler.cancel_dump_traceback_later()
        try:
            comm.destroy()
        except Exception:  # noqa: BLE001, S110 - the group may already be broken by the failure
            pass


# ------------------------------------------------------------------------------------------ parent side
def _context(start_method: str):
    if start_method == "forkserver":
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    if start_method == "spawn":
        return mp.get_context("spawn")
    raise InvalidArgument(f"start_method must be 'forkserver' or 'spawn' (a clean interpreter), got {start_method!r}")


def _check_fn(fn) -> None:
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<locals>" in qualname or "<lambda>" in qualname:
        raise InvalidArgument(
            f"run_ranks needs a module-level function (it is pickled by name into each rank); got {fn!r}. "
            "Move it to the top level of its module."
        )


def _read(conn, rank: int, proc, stderr_path: str) -> RankOutcome:
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        proc.join(1.0)
        last = _tail(stderr_path)
        words = f"; its last words on stderr:\n{last}" if last else " and wrote nothing to stderr"
        return RankOutcome(rank, False, exc_type="RankDied",
                           message=f"rank {rank} exited with code {proc.exitcode} without reporting a result{words}",
                           traceback=f"(no Python traceback: the process ended abruptly)\n{last}\n", when=time.time())
    if msg[0] == "ok":
        return RankOutcome(rank, True, value=pickle.loads(msg[1]))
    _, exc_type, text, tb, original, when = msg
    exception = None
    if original is not None:
        try:
            exception = pickle.loads(original)
        except Exception:  # noqa: BLE001
            exception = None
    return RankOutcome(rank, False, exc_type=exc_type, message=text, traceback=tb, exception=exception, when=when)


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().rstrip().splitlines()[-lines:])
    except OSError:
        return ""


def _forward_stderr(paths: list[str]) -> None:
    """Hand what the ranks wrote to stderr on to ours, so nothing they said is lost."""
    for rank, path in enumerate(paths):
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        if text.strip():
            sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2.0)


def _read_dump(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def run_ranks(fn, world_size: int, *args, timeout: float = 60.0, backend: str = "gloo", comm_timeout=None,
              env: dict | None = None, start_method: str = "forkserver") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return the results by rank.

    ``timeout`` bounds the whole run (hung ranks are killed); ``comm_timeout`` is the
    process-group timeout given to :func:`polyaccel.comm.init_distributed` (None: its default
    rules); ``env`` adds environment variables for the ranks.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgument(f"world_size must be a positive int, got {world_size!r}")
    if not timeout or timeout <= 0:
        raise InvalidArgument(f"timeout must be a positive number of seconds, got {timeout!r}")
    _check_fn(fn)
    import torch.distributed as dist

    ctx = _context(start_method)
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    child_env = dict(os.environ)
    child_env.update(env or {})
    files = _RankFiles(world_size)
    procs, readers = [], {}
    try:
        _start_ranks(ctx, procs, readers, files, fn, world_size, args, child_env, store.port, backend, comm_timeout,
                     dump_after=max(0.5, timeout - min(2.0, timeout * 0.1)))
        outcomes, first_failure = _collect_outcomes(readers, procs, files.errs, world_size, timeout)
        hung = [r for r in range(world_size) if r not in outcomes]
        _kill(procs)
    finally:
        _kill(procs)
        for conn in readers:
            conn.close()
        del store

    _forward_stderr(files.errs)
    try:
        if first_failure is not None:
            primary = min((o for o in outcomes.values() if not o.ok), key=lambda o: (o.secondary, o.when, o.rank))
            _raise_failure(primary.rank, outcomes, hung, world_size)
        if hung:
            _raise_timeout(fn, hung, world_size, timeout, files.dumps)
        return [outcomes[r].value for r in range(world_size)]
    finally:
        files.remove()


class _RankFiles:
    """Per rank, in one temporary folder: where faulthandler dumps its stack and where its stderr goes."""

    def __init__(self, world_size: int):
        self.tmpdir = tempfile.mkdtemp(prefix="polyaccel-ranks-")
        self.dumps = [os.path.join(self.tmpdir, f"rank{rank}.stack") for rank in range(world_size)]
        self.errs = [os.path.join(self.tmpdir, f"rank{rank}.stderr") for rank in range(world_size)]

    def remove(self) -> None:
        for d in self.dumps + self.errs:
            try:
                os.unlink(d)
            except OSError:
                pass
        try:
            os.rmdir(self.tmpdir)
        except OSError:
            pass


def _start_ranks(ctx, procs: list, readers: dict, files: _RankFiles, fn, world_size: int, args: tuple,
                 child_env: dict, port: int, backend: str, comm_timeout, dump_after: float) -> None:
    """Start every rank with the write end of its result pipe; fill ``procs`` and ``readers`` (read end ->
    rank) as they start, so a failure part-way still lets the caller kill what runs."""
    for rank in range(world_size):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_rank_main, name=f"polyaccel-rank{rank}", daemon=False,  # ranks may start workers
            args=(fn, rank, world_size, args, child_env, port, backend, comm_timeout, writer, files.dumps[rank],
                  dump_after, files.errs[rank]),
        )
        proc.start()
        writer.close()
        procs.append(proc)
        readers[reader] = rank


def _collect_outcomes(readers: dict, procs: list, errs: list[str], world_size: int,
                      timeout: float) -> tuple[dict[int, RankOutcome], int | None]:
    """Read each rank's outcome as it arrives, until all are in or the timeout passes (after a first failure,
    the others get :data:`GRACE_S` more); return the outcomes by rank and the first failed rank, if any."""
    outcomes: dict[int, RankOutcome] = {}
    first_failure: int | None = None
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size:
        now = time.monotonic()
        if now >= deadline:
            break
        pending = [c for c, r in readers.items() if r not in outcomes]
        for conn in wait_ready(pending, timeout=deadline - now):
            rank = readers[conn]
            outcome = _read(conn, rank, procs[rank], errs[rank])
            outcomes[rank] = outcome
            if not outcome.ok and first_failure is None:
                first_failure = rank
                deadline = min(deadline, time.monotonic() + GRACE_S)
    return outcomes, first_failure


def _raise_timeout(fn, hung: list[int], world_size: int, timeout: float, dumps: list[str]) -> None:
    stacks = "\n".join(f"--- rank {r} was here when the timeout hit ---\n{_read_dump(dumps[r]) or '(no dump)'}"
                       for r in hung)
    raise RanksTimeout(
        f"rank(s) {hung} of {world_size} did not finish within {timeout:g} s and were killed "
        f"(function {fn.__module__}.{fn.__qualname__}).\n{stacks}",
        rank=hung[0], exc_type="Timeout", remote_traceback=stacks, failures={},
    )


def _raise_failure(rank: int, outcomes: dict[int, RankOutcome], hung: list[int], world_size: int) -> None:
    first = outcomes[rank]
    failures = {r: o for r, o in outcomes.items() if not o.ok}
    others = [f"rank {r}: {o.exc_type}: {o.message.splitlines()[0] if o.message else ''}"
              for r, o in sorted(failures.items()) if r != rank]
    if hung:
        others.append(f"rank(s) {hung} were still running and were killed")
    text = f"rank {rank} of {world_size} failed: {first.exc_type}: {first.message}\n"
    text += f"--- traceback from rank {rank} ---\n{first.traceback.rstrip()}"
    if others:
        text += "\n--- other ranks ---\n" + "\n".join(others)
    err = RankFailure(text, rank=rank, exc_type=first.exc_type, remote_traceback=first.traceback, failures=failures)
    if first.exception is not None:
        raise err from first.exception
    raise err


__all__ = ["GRACE_S", "PRELOAD", "RankFailure", "RankOutcome", "RanksTimeout", "run_ranks"]
