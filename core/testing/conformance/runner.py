"""Run the suite in a fresh Python process and read its JSON document back.

A separate process keeps the run honest: the accelerator is selected from scratch
(exactly as an application would select it), an emulated runtime is installed before
anything else, and nothing the caller has imported or patched leaks in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from . import results
from .progress import SuiteProgress

#: the option the suite's process takes the progress pipe's file descriptor by (:mod:`.progress`)
PROGRESS_OPTION = "--polyaccel-progress-fd"

#: run the checks in this many pytest-xdist processes (0 or 1: one process; unset: :func:`auto_workers`)
WORKERS_ENV = "POLYACCEL_CONFORMANCE_WORKERS"
#: :func:`auto_workers`: a process per this many host CPUs, at most this many processes
CPUS_PER_WORKER = 4
MAX_AUTO_WORKERS = 4

SUITE_PACKAGE = "polyaccel.testing.conformance"
PYTEST_PLUGIN = f"{SUITE_PACKAGE}.plugin"


@dataclass
class SuiteRun:
    """What one run produced: the document (None if the suite could not even start)."""

    document: dict[str, Any] | None
    returncode: int
    output: str
    command: list[str]

    @property
    def ok(self) -> bool:
        return bool(self.document and self.document["ok"]) and self.returncode == 0

    def rows(self) -> list[dict[str, Any]]:
        return list(self.document["rows"]) if self.document else []

    def error(self) -> str | None:
        if self.document and self.document.get("error"):
            return self.document["error"]
        if self.document is None:
            return f"the suite produced no result (pytest exit status {self.returncode}):\n{_last_lines(self.output)}"
        return None


def pytest_command(accelerator: str | None, *, emulate: bool = False, json_path: str | None = None,
                   keyword: str | None = None, junitxml: str | None = None, verbose: bool = False,
                   ini_path: str | None = None, extra_args: tuple[str, ...] = (), fuzz: bool = False,
                   fuzz_examples: int | None = None, fuzz_seed: int | None = None,
                   workers: int = 1) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", PYTEST_PLUGIN, "-p", "no:cacheprovider",
           "--import-mode=importlib", "--pyargs", SUITE_PACKAGE, "-rfE", "-v" if verbose else "-q"]
    if ini_path:
        cmd += ["-c", ini_path]  # ignore whatever pytest configuration the caller's folder has
    if accelerator:
        cmd += ["--polyaccel-accelerator", accelerator]
    if emulate:
        cmd.append("--polyaccel-emulate")
    if json_path:
        cmd += ["--polyaccel-json", json_path]
    if keyword:
        cmd += ["-k", keyword]
    if fuzz:
        cmd.append("--polyaccel-fuzz")
        if fuzz_examples is not None:
            cmd += ["--polyaccel-fuzz-examples", str(fuzz_examples)]
        if fuzz_seed is not None:
            cmd += ["--polyaccel-fuzz-seed", str(fuzz_seed)]
    if junitxml:
        cmd += ["--junitxml", os.path.abspath(junitxml)]
    if workers > 1:
        cmd += ["-n", str(workers)]
    return cmd + list(extra_args)


def workers_from_env(env: dict[str, str] | None = None) -> int | None:
    """The process count :data:`WORKERS_ENV` asks for (None when unset); a bad value or a missing
    pytest-xdist is refused, naming the variable."""
    raw = (os.environ if env is None else env).get(WORKERS_ENV, "").strip()
    if not raw:
        return None
    try:
        workers = int(raw)
    except ValueError:
        raise ConfigError(f"{WORKERS_ENV}={raw!r} is not a whole number of processes") from None
    return checked_workers(workers, f"{WORKERS_ENV}={raw!r}")


def checked_workers(workers: int, given: str) -> int:
    """``workers`` (0 and 1: one process) when it can be honoured here; ``given`` names where it came from."""
    if workers < 0:
        raise ConfigError(f"{given} must be 0 or more (0 and 1: one process)")
    if workers > 1 and not _has_xdist():
        raise ConfigError(f"{given} runs the checks in pytest-xdist processes, which is not installed here: "
                          "pip install pytest-xdist (or polyaccel[conformance]), or ask for one process")
    return max(workers, 1)


def auto_workers(cpus: int | None = None) -> int:
    """The default process count: one per :data:`CPUS_PER_WORKER` host CPUs, at most :data:`MAX_AUTO_WORKERS`,
    one where pytest-xdist is missing. On a GPU with an empty kernel cache a run is mostly compiling, which
    then happens in parallel (an H100 host of 16 CPUs: 4 processes, 137 s -> 42 s); a small host keeps one."""
    if not _has_xdist():
        return 1
    cpus = os.cpu_count() if cpus is None else cpus
    return max(1, min(MAX_AUTO_WORKERS, (cpus or 1) // CPUS_PER_WORKER))


def resolve_workers(requested: int | None = None, env: dict[str, str] | None = None) -> int:
    """The processes a run uses: ``requested`` (``--workers``), else :data:`WORKERS_ENV`, else
    :func:`auto_workers`."""
    if requested is not None:
        return checked_workers(requested, f"--workers {requested}")
    from_env = workers_from_env(env)
    return auto_workers() if from_env is None else from_env


def _has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def run_suite(accelerator: str | None = None, *, emulate: bool = False, keyword: str | None = None,
              junitxml: str | None = None, json_path: str | None = None, verbose: bool = False,
              env: dict[str, str] | None = None, timeout: float | None = 900.0,
              extra_args: tuple[str, ...] = (), fuzz: bool = False, fuzz_examples: int | None = None,
              fuzz_seed: int | None = None, progress: Callable[[SuiteProgress], None] | None = None,
              workers: int | None = None) -> SuiteRun:
    """Run the conformance suite against ``accelerator`` (None: the normally selected one).

    ``fuzz`` adds the op-contract fuzz rows (``fuzz_examples`` drawn cases per op and builder,
    from ``fuzz_seed`` or a fixed derandomized set: :mod:`polyaccel.testing.conformance.fuzz`).

    ``json_path`` keeps the document (else a temporary file is used); ``env`` replaces the
    child's environment (default: this process's). ``workers`` pytest-xdist processes run the checks
    (None: ``POLYACCEL_CONFORMANCE_WORKERS`` in ``env``, else one per four host CPUs up to four:
    :func:`resolve_workers`); the document is the same whatever the count. ``progress(tracker)`` is
    called (from another thread) as each check starts and finishes
    (:class:`.progress.SuiteProgress`). Raises
    ``TimeoutError`` after ``timeout`` seconds, having killed the run, naming the check it was on.
    """
    with tempfile.TemporaryDirectory(prefix="polyaccel-conformance-") as tmp:
        ini = os.path.join(tmp, "pytest.ini")
        with open(ini, "w") as fh:
            fh.write("[pytest]\n")
        out_json = os.path.abspath(json_path) if json_path else os.path.join(tmp, "conformance.json")
        if json_path and os.path.exists(out_json):
            os.unlink(out_json)  # never report a previous run's document
        cmd = pytest_command(accelerator, emulate=emulate, json_path=out_json, keyword=keyword, junitxml=junitxml,
                             verbose=verbose, ini_path=ini, extra_args=extra_args, fuzz=fuzz,
                             fuzz_examples=fuzz_examples, fuzz_seed=fuzz_seed, workers=resolve_workers(workers, env))
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("PYTHONUNBUFFERED", "1")  # what it printed reaches the pipe, should it be killed
        tracker = SuiteProgress(progress)
        read_end, write_end = os.pipe()
        try:
            proc = subprocess.Popen(cmd + [PROGRESS_OPTION, str(write_end)], cwd=tmp, env=child_env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(write_end,))
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        tracker.follow(read_end)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            tracker.join(5.0)
            tail = _last_lines(output)
            printed = f"the last it printed:\n{tail}" if tail else "it printed nothing"
            raise TimeoutError(f"the conformance suite did not finish within {timeout} s: {tracker.describe()} "
                               f"(command: {' '.join(cmd)}); {printed}") from None
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
        tracker.join(5.0)
        document = results.load(out_json) if os.path.exists(out_json) else None
        return SuiteRun(document=document, returncode=proc.returncode, output=output, command=cmd)


def _last_lines(output: str | None) -> str:
    """The end of what the suite's process printed (its last 15 lines)."""
    return "\n".join((output or "").strip().splitlines()[-15:])
