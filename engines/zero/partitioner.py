"""What the stage 1/2 and stage 3 partitioners share: their settings and the reduce-scatter of gradient
buckets.

:class:`PartitionSetup` is what the engine hands each group's partitioner besides its
parameters and its process group: the validated :class:`~.config.ZeroConfig` (every tunable
comes from there), the :class:`~.placement.Placement` (where the optimizer and the shards live)
and the engine's runtime resources (device, dtypes, host buffers, streams).
:class:`ReduceScatter` does the reduce-scatter of one gradient bucket and the wait for the
reductions still in flight, which both stages do the same way; a stage gives it ``settle``
(where a reduced bucket goes) and keys its buckets as it likes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import ZeroConfig
from .offload import HostBuffers, HostTransfer
from .placement import Placement


@dataclass(frozen=True)
class PartitionSetup:
    """The engine's settings for one group's partitioner (see :mod:`.engine`).

    ``alloc_master(numel, dtype)`` allocates a master-dtype partition where the optimizer steps (the host
    under optimizer offload, else the device); ``eager`` False means every bucket is reduced after backward
    (the engine orders several groups); ``divisor`` is how many data-parallel ranks gradients are averaged
    over (None: the group's world size); ``grad_dtype`` is the gradient partition's dtype (None: the master
    dtype).
    """

    config: ZeroConfig
    placement: Placement
    device: torch.device
    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    alloc_master: Callable[[int, torch.dtype], torch.Tensor]
    host: HostBuffers
    accelerator: object = None
    reduction_stream: object = None
    transfer: HostTransfer | None = None
    eager: bool = True
    divisor: int | None = None
    grad_dtype: torch.dtype | None = None


class ReduceScatter:
    """Averages flat gradient buckets over the ranks and reduce-scatters them, then hands each result to
    ``settle(key, out)``: on the reduction stream when there is one, else asynchronously with
    ``overlap_comm``; settled at once when done, otherwise by :meth:`finish`."""

    def __init__(self, coll, setup: PartitionSetup, transfer: HostTransfer, divisor: int,
                 settle: Callable[[object, torch.Tensor], None]):
        self.coll = coll
        self.overlap = setup.config.overlap_comm
        self.stream = setup.reduction_stream
        self.accelerator = setup.accelerator
        self.transfer = transfer
        self.divisor = divisor
        self.settle = settle
        # (bucket key, work, reduced output, input kept alive until the work is done)
        self._pending: list = []

    def launch(self, key, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Average ``inp`` (a flat bucket) over the ranks and reduce-scatter it into ``out``."""
        if self.stream is not None:
            self.stream.wait_stream(self.accelerator.current_stream())
            with self.accelerator.stream(self.stream):
                inp.div_(self.divisor)
                work = self.coll.reduce_scatter(out, inp, async_op=False)
        else:
            inp.div_(self.divisor)
            work = self.coll.reduce_scatter(out, inp, async_op=self.overlap)
            if work is None:  # done: settle now, so the bucket's device memory goes back while backward runs
                self.settle(key, out)
                return
        self._pending.append((key, work, out, inp))

    def finish(self) -> None:
        """Wait for every reduction in flight and settle it; then flush the copies to the host."""
        if self.stream is not None:
            self.accelerator.current_stream().wait_stream(self.stream)
        for key, work, out, _inp in self._pending:
            if work is not None:
                work.wait()
            self.settle(key, out)
        self._pending.clear()
        self.transfer.flush()


class Partitioner:
    """Common state of :class:`~.stage12.FlatPartitioner` and :class:`~.stage3.ShardedParameters`."""

    def __init__(self, coll, setup: PartitionSetup):
        self.coll = coll
        self.world, self.rank = coll.world, coll.rank
        self.device = setup.device
        self.compute_dtype = setup.compute_dtype
        self.placement = setup.placement
        self.bucket_size = setup.config.reduce_bucket_size
        self.accelerator = setup.accelerator
        # False: reduce every bucket after backward (the engine orders several groups)
        self.eager = setup.eager
        # gradients are averaged over this many data-parallel ranks
        self.divisor = setup.divisor or coll.world
        #: ``alloc(numel, dtype)`` for this partitioner's master, moment and gradient partitions
        self.alloc_master = setup.alloc_master
        self.transfer = setup.transfer or HostTransfer(HostBuffers(setup.accelerator), setup.accelerator,
                                                       setup.device)
        self._hooks: list = []

    def reduce_scatter(self, settle: Callable[[object, torch.Tensor], None],
                       setup: PartitionSetup) -> ReduceScatter:
        """The reduce-scatter of this partitioner's buckets, settled by ``settle``."""
        return ReduceScatter(self.coll, setup, self.transfer, self.divisor, settle)

    @property
    def grad(self) -> torch.Tensor:
        """This rank's gradient partition (see :class:`~.partition.GradientPartition`)."""
        return self._grad.get()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
