"""The offloaded optimizer step, run bucket by bucket while backward is still running.

With the optimizer offloaded, a bucket's gradient lands in host memory long before backward
ends. When nothing about the step depends on the whole gradient — no clipping, no fp16
overflow check, no accumulation over micro-steps, no reduction of the partition after
backward — the host can step that bucket's slice right away and upload its 16-bit result,
overlapping the host optimizer with the rest of backward instead of running after it.

One worker thread takes the buckets in the order they settle. For each it waits until the
bucket's copy down has landed (an event recorded after the copy, where the device has
events; on the cpu plugin the copy is already done), steps the slice and starts its upload.
Overwriting a bucket's parameters while backward runs is safe because a bucket settles only
after every one of its parameters' gradient hooks fired, and no kernel reads a parameter
after its gradient was accumulated — unless backward revisits it (reentrant checkpointing of a
shared weight): then :class:`OverlapError` stops the step before it is applied twice.

The worker's CPU kernels run on one core fewer than torch's intra-op setting (or on
``offload_optimizer.host_threads``): backward's kernels are launched by another thread meanwhile,
and an OpenMP team that shares every core with it waits at each barrier for whichever member the
scheduler preempted.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from polyaccel.errors import PolyaccelError

from .split_partition import SplitPartition


class OverlapError(PolyaccelError):
    """A gradient arrived for a bucket whose optimizer step had already started."""


def overlap_message(name: str) -> str:
    return (f"the gradient of {name!r} arrived after its bucket's offloaded optimizer step had started (backward "
            "visited it twice, as reentrant activation checkpointing of a shared weight does); set "
            "zero_optimization.offload_optimizer.overlap_step to false to step after backward instead")


def worker_threads(configured: int | None = None) -> int:
    """Intra-op threads of the host-step worker: ``configured``, else one fewer than torch's (at least one)."""
    return configured if configured is not None else max(1, torch.get_num_threads() - 1)


def _start_worker(threads: int) -> None:
    torch.get_num_threads()  # torch's first use in a thread applies its global setting: done before ours
    torch.set_num_threads(threads)  # this thread's OpenMP team (and the global setting, put back by the caller)


class HostStepper:
    def __init__(self, transfer, threads: int | None = None):
        self.transfer = transfer
        self.threads = threads
        self.accelerator = transfer.accelerator
        self.has_events = transfer.crosses and self.accelerator.has("events")
        #: a bucket's arrival can be waited for alone: an event after its copy, or no copy at all
        self.available = self.has_events or not transfer.crosses
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self._group = None
        self.active = False

    def begin(self, group, compute_dtype) -> None:
        """Start a step of ``group`` that buckets will join as they settle."""
        self.wait()
        self._group = group
        group.optimizer.begin_step()
        self.transfer.start_upload(group.partitioner.master.numel(), compute_dtype)
        self.transfer.defer_settle = True  # backward's kernels must not wait for the uploads: joined in finish
        self.active = True

    def submit(self, ranges: list[tuple[int, int]]) -> None:
        """Step and upload these master ranges once the copy down just issued has landed. Ranges kept on the
        device (a partial offload, see :mod:`.split_partition`) are stepped at once, in the caller's stream
        order, right after their gradient."""
        master = self._group.partitioner.master
        if isinstance(master, SplitPartition):
            ranges = [piece for lo, hi in ranges for piece in master.ranges(lo, hi)]
            self._run([r for r in ranges if master.on_device(r[0])], None)
            ranges = [r for r in ranges if not master.on_device(r[0])]
            if not ranges:
                return
        event = self.transfer.copy_event("down") if self.has_events else None
        if self._pool is None:
            self._pool = self._make_pool(worker_threads(self.threads))
        self._futures.append(self._pool.submit(self._run, ranges, event))

    @staticmethod
    def _make_pool(threads: int) -> ThreadPoolExecutor:
        """The worker, started now on ``threads``, then torch's default put back for threads made later (the
        caller's own team is not touched)."""
        before = torch.get_num_threads()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyaccel-host-step",
                                  initializer=_start_worker, initargs=(threads,))
        pool.submit(int).result()
        torch.set_num_threads(before)
        return pool

    def _run(self, ranges, event) -> None:
        if event is not None:
            event.synchronize()
        g = self._group
        for lo, hi in ranges:
            g.optimizer.step_slice(g.partitioner.grad, lo, hi)
            if g.optimizer.slice_done(lo, hi):  # else uploaded by the optimizer's finish_step
                g.partitioner.upload(lo, hi)

    def wait(self) -> None:
        """Finish every submitted bucket (re-raising a worker's error)."""
        futures, self._futures = self._futures, []
        for f in futures:
            f.result()

    def finish(self) -> None:
        """End of the step: every bucket is stepped and uploaded (or uploading)."""
        try:
            self.wait()
        finally:
            self.active = False
            self.transfer.defer_settle = False
            self.transfer.settle()  # the next forward reads the uploaded parameters

    def close(self) -> None:
        self.active = False
        self.transfer.defer_settle = False
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
