"""Which check the suite's process is on, told to the process that runs it.

A run on a fresh GPU can spend minutes compiling kernels with nothing to print, and a run killed at
its timeout must say where it stopped. The suite's process writes one JSON line per event to a
pipe the runner opens (``--polyaccel-progress-fd``): ``{"total": n}`` once collected, then
``{"start": nodeid}`` and ``{"finish": nodeid}`` around each check. :class:`SuiteProgress` reads them.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable


class ProgressWriter:
    """The suite's side (a pytest plugin object): the events, written to file descriptor ``fd``."""

    def __init__(self, fd: int) -> None:
        self._out = os.fdopen(fd, "w", buffering=1)

    def _emit(self, **event) -> None:
        try:
            self._out.write(json.dumps(event) + "\n")
        except (BrokenPipeError, ValueError):  # nobody reads any more: the run goes on untold
            pass

    def pytest_collection_finish(self, session) -> None:
        self._emit(total=len(session.items))

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        self._emit(start=nodeid)

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        self._emit(finish=nodeid)

    def pytest_unconfigure(self, config) -> None:
        try:
            self._out.close()
        except BrokenPipeError:
            pass


class SuiteProgress:
    """The runner's side: the checks collected, done and running, from the events read off ``fd`` (in a thread,
    :meth:`follow`); ``on_change(self)`` is called after each event."""

    def __init__(self, on_change: Callable[[SuiteProgress], None] | None = None) -> None:
        self.total: int | None = None
        self.done = 0
        self.running: str | None = None
        self._on_change = on_change
        self._thread: threading.Thread | None = None

    def follow(self, fd: int) -> None:
        self._thread = threading.Thread(target=self._read, args=(fd,), name="conformance-progress", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r") as events:
            for line in events:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if "total" in event:
                    self.total = int(event["total"])
                elif "start" in event:
                    self.running = str(event["start"])
                elif "finish" in event:
                    self.done += 1
                    self.running = None
                if self._on_change is not None:
                    self._on_change(self)

    def describe(self) -> str:
        """Where the run is, in words: the check running, and how many are done."""
        of = f" of {self.total}" if self.total is not None else ""
        if self.running is not None:
            return f"it was running {self.running} ({self.done}{of} checks done)"
        if self.total is None:
            return "it had not finished collecting the checks"
        return f"{self.done}{of} checks were done"
