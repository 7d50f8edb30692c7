"""Which peer died: each rank leaves its host and pid in the process group's store at start-up.

When a collective fails because a peer closed its connection, c10d names only a socket
address. The survivor looks the peers up in the store and checks, for those on its own
host, whether their process still runs, so its error can say which rank died.
"""

from __future__ import annotations

import os
import socket
import time

import torch.distributed as dist

_KEY = "polyaccel/peer/{}"


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or a torch without the helper
        return None


def publish() -> None:
    """Record this rank's host and pid (best effort: a store without room or a broken one is ignored)."""
    store = _store()
    if store is None:
        return
    try:
        store.set(_KEY.format(dist.get_rank()), f"{socket.gethostname()} {os.getpid()}")
    except Exception:  # noqa: BLE001, S110
        pass


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def describe_lost(wait_s: float = 3.0) -> str:
    """'rank 1 (pid 4242 on this host) is no longer running', or '' when none is known to be gone.

    A peer whose socket closed may still be exiting (an abort takes a moment): look again for up to
    ``wait_s`` seconds before answering that none is gone."""
    store = _store()
    if store is None or not dist.is_initialized():
        return ""
    host = socket.gethostname()
    peers = {}
    try:
        me = dist.get_rank()
        for r in range(dist.get_world_size()):
            key = _KEY.format(r)
            if r == me or not store.check([key]):
                continue
            peer_host, pid = store.get(key).decode().rsplit(" ", 1)
            if peer_host == host:
                peers[r] = int(pid)
    except Exception:  # noqa: BLE001 - the store may have died with the peer
        return ""
    deadline = time.monotonic() + wait_s
    while True:
        gone = [f"rank {r} (pid {pid} on this host)" for r, pid in peers.items() if not _running(pid)]
        if gone or not peers or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not gone:
        return ""
    verb = "is" if len(gone) == 1 else "are"
    return f"{', '.join(gone)} {verb} no longer running; its output (stderr) holds its last words"
