"""One writer at a time in a checkpoint directory: an exclusive ``flock`` on a hidden lock file.

Two processes saving into one directory at once would mix their files (one removes the other's staging
folder, each ``latest`` names a folder the other rewrote). The first to take the lock writes; the second is
refused before it writes anything, told who holds it (pid, host, what, since when). The holder removes the
file when it is done; the kernel drops a ``flock`` when its holder exits, however it exits, so a file left by a
crash or SIGKILL holds no lock and the next writer takes it. On filesystems without ``flock`` (some network
mounts) the lock cannot be taken and the writer goes on unguarded, as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from .errors import PolyaccelError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX
    fcntl = None


class LockHeld(PolyaccelError):
    """Another process holds the directory's lock; ``holder`` is its description (may be empty)."""

    def __init__(self, message: str, path: Path, holder: dict):
        super().__init__(message)
        self.path = path
        self.holder = holder


def describe(holder: dict) -> str:
    if not holder:
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"{holder.get('what', 'a writer')} (pid {holder.get('pid')} on {holder.get('host')}, since {since})"


class DirectoryLock:
    """``with DirectoryLock(dir, name, what):`` holds ``dir/name`` exclusively, or raises :class:`LockHeld`."""

    def __init__(self, directory, name: str, what: str):
        self.path = Path(directory) / name
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        if fcntl is None or self._fd is not None:
            return self
        for _ in range(20):  # the file may be removed by its releasing holder between our open and our flock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise LockHeld(f"{self.path.parent} is being written by {describe(holder)}; two writers in one "
                               f"directory would mix their checkpoints' files", self.path, holder) from None
            except OSError:  # no flock here (a network filesystem): unguarded, as before
                os.close(fd)
                return self
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # we locked a file its holder had just removed: take the one at the path now
        else:  # pragma: no cover - twenty holders in a row removing it under us
            return self
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": self.what,
                             "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the file (while still holding it: a process that opened it meanwhile sees it gone and retries),
        then drop the lock."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data) if data else {}
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


__all__ = ["DirectoryLock", "LockHeld", "describe"]
