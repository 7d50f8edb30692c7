"""One rank of the teardown tests (run as a script, with MASTER_ADDR/PORT, RANK, WORLD_SIZE set).

``python teardown_rank.py MODE``. Every call to ``torch.distributed.destroy_process_group`` prints
``destroy-called``; an exit hook registered before polyaccel's (so it runs after it) prints whether a
group is still alive at the very end (``alive-at-end True/False``).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

MODE = sys.argv[1]
_destroy = dist.destroy_process_group


def _counted_destroy(*args, **kwargs):
    print("destroy-called", flush=True)
    return _destroy(*args, **kwargs)


dist.destroy_process_group = _counted_destroy


def _last_word() -> None:
    print(f"alive-at-end {dist.is_initialized()}", flush=True)
    if MODE == "sigint-twice":
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again, while the process is already exiting
        time.sleep(5)
        print("not reached", flush=True)


atexit.register(_last_word)

from polyaccel import comm  # noqa: E402

if MODE == "user-group":
    dist.init_process_group("gloo")
if MODE == "user-handler":
    def _users_own(signum, frame):
        print("user handler", flush=True)

    signal.signal(signal.SIGTERM, _users_own)
comm.init_distributed(backend="gloo")
if MODE == "user-handler":
    print(f"handler kept {signal.getsignal(signal.SIGTERM) is _users_own}", flush=True)
t = torch.full((3,), float(dist.get_rank() + 1))
comm.all_reduce(t)
expected = float(sum(range(1, dist.get_world_size() + 1)))
assert t.tolist() == [expected] * 3, t
print("reduced", flush=True)

if MODE == "raise" and dist.get_rank() == 1:
    raise ValueError("the user's own error")
if MODE in ("sigterm", "sigint", "sigint-twice"):
    signum = signal.SIGTERM if MODE == "sigterm" else signal.SIGINT
    os.kill(os.getpid(), signum)
    time.sleep(5)  # the signal lands here
    print("not reached", flush=True)
if MODE == "destroy-then-exit":
    comm.destroy()
