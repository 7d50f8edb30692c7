"""Stage 3's gradient reduction: fixed buckets of whole parameters, reduce-scattered into the partition.

Buckets are fixed groups of about ``reduce_bucket_size`` gathered elements (at world size 1 one
parameter each, unless the optimizer is offloaded), reduce-scattered into each rank's gradient
partition in the rank-independent order of :class:`~.bucket_order.BucketOrder`; with peers, at the
next point every rank reaches (see :mod:`.stage3`), once complete on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .bucket_order import BucketOrder
from .host_step import OverlapError, overlap_message


class ShardGradients:
    """The gradients of the stage-3 parameters ``infos`` of partitioner ``part``, on their way into its
    gradient partition ``grad_partition`` (laid out as ``part.layout``); ``release(info)`` lets a parameter go
    once its gradient is held."""

    def __init__(self, part, setup, infos, grad_partition, release: Callable):
        self.world, self.device, self.compute_dtype = part.world, part.device, part.compute_dtype
        self.coll, self.divisor, self.bucket_size = part.coll, part.divisor, part.bucket_size
        self.layout, self.transfer, self.optimizer_home = part.layout, part.transfer, part.placement.optimizer
        self._grad = grad_partition
        self._release = release
        self.reductions = part.reduce_scatter(self._settle, setup)
        self.by_index = {i.index: i for i in infos if i.index is not None}
        self.on_settle = None  # called with a bucket's master ranges once its gradient is on its way to them
        self._unwritten = set(self.by_index)
        self._buckets = self._grad_buckets()
        self.order = BucketOrder(self._buckets)
        self._grads: dict[int, torch.Tensor] = {}  # layout index -> full gradient waiting for its bucket
        self.eager = part.eager
        # With peers, a bucket's reduction waits for the next point where every rank is (a gather's agreement,
        # or a backward fetch without the check): reducing as soon as a bucket is complete here would put the
        # reduce-scatter between other gathers on each rank, wherever its local gradients happened to arrive.
        self.sync = self.world > 1 and self.eager

    def _grad_buckets(self) -> list[list[int]]:
        """Fixed reduction buckets: trainable parameters in reverse registration order (roughly the order
        backward produces them), about ``reduce_bucket_size`` gathered elements each.

        At world size 1 every parameter is a bucket of its own unless the optimizer is offloaded: with
        nothing to exchange there is no collective to amortise, and waiting for a full bucket would hold a
        bucket's worth of gradients in backward, where the step's memory peaks. With the optimizer offloaded
        a bucket is also the unit of the copy down and of the overlapped host step, whose fixed costs (an
        event, a thread hand-off, an optimizer call, an upload) are paid per bucket."""
        limit = 1 if self.world == 1 and not self.optimizer_home.on_host else self.bucket_size
        buckets, current, elems = [], [], 0
        for index in sorted(self.by_index, reverse=True):
            info = self.by_index[index]
            if not info.numel:
                continue
            current.append(index)
            elems += info.shard_size * self.world
            if elems >= limit:
                buckets.append(current)
                current, elems = [], 0
        if current:
            buckets.append(current)
        return buckets

    def on_grad(self, info) -> None:
        if self.on_settle is not None and self.order.would_reopen(info.index):
            raise OverlapError(overlap_message(info.name))
        p = info.param
        g = p.grad.detach().reshape(-1)
        held = self._grads.get(info.index)
        self._grads[info.index] = g if held is None else held + g
        p.grad = None
        info.held = False
        self._release(info)
        if self.sync:
            self.order.record(info.index)
        elif self.eager:
            for k in self.order.arrive(info.index):
                self._reduce_bucket(k)

    def ready(self) -> int:
        """How many buckets are complete here and wait for the others (0 when buckets are reduced at once)."""
        return self.order.ready() if self.sync else 0

    def take(self, common: int) -> None:
        """Reduce the buckets complete on every rank (``common``, the least of the ranks' :meth:`ready`)."""
        if self.sync:
            for k in self.order.take(common):
                self._reduce_bucket(k)

    def reduce_complete_everywhere(self) -> None:
        """Without the schedule check: at a backward fetch (the same on every rank when the schedule is),
        reduce the buckets complete on every rank (one all-reduce of the ready count)."""
        ready = torch.tensor([-self.order.ready()], dtype=torch.int64)
        common = -int(self.coll.all_reduce(ready, op="max").item())
        for k in self.order.take(common):
            self._reduce_bucket(k)

    def _reduce_bucket(self, k: int) -> None:
        entries = [self.by_index[i] for i in self._buckets[k]]
        if self.world == 1:  # nothing to exchange: the gradients themselves (one parameter: no packed copy)
            flat = [self._grads.pop(i.index, None) for i in entries]
            flat = [torch.zeros(i.numel, dtype=self.compute_dtype, device=self.device) if g is None
                    else g.to(self.compute_dtype) for g, i in zip(flat, entries, strict=True)]
            g = flat[0] if len(flat) == 1 else torch.cat(flat)
            self._settle(entries, g / self.divisor if self.divisor != 1 else g)
            return
        total = sum(i.shard_size for i in entries)
        inp = torch.zeros(self.world, total, dtype=self.compute_dtype, device=self.device)
        col = 0
        for info in entries:
            s = info.shard_size
            g = self._grads.pop(info.index, None)
            if g is not None:  # no gradient here this backward: zeros
                if s * self.world != info.numel:
                    g = F.pad(g, (0, s * self.world - info.numel))
                inp[:, col:col + s].copy_(g.view(self.world, s))
            col += s
        out = torch.empty(total, dtype=self.compute_dtype, device=self.device)
        self.reductions.launch(entries, out, inp.view(-1))

    def _settle(self, entries: list, out: torch.Tensor) -> None:
        col, every_fresh, grad = 0, True, self._grad.get()
        for info in entries:
            s = info.shard_size
            off = self.layout.part_offsets[info.index]
            fresh = info.index in self._unwritten  # the first gradient since zero_grad overwrites
            self._unwritten.discard(info.index)
            self.transfer.add_later(grad[off:off + s], out[col:col + s], grad, fresh, track=False)
            every_fresh = every_fresh and fresh
            col += s
        # the norm on the way down only for a partition on the host, which should never have to reduce it; one
        # on the device is reduced once at the step (one kernel, not four launches per bucket)
        if self.optimizer_home.on_host:
            self.transfer.track(grad, out[:col], every_fresh)
        if self.on_settle is not None:
            self.on_settle(self._master_ranges(entries))

    def _master_ranges(self, entries: list) -> list[tuple[int, int]]:
        """The ranges of the partition ``entries``' shards cover, adjacent ones merged."""
        ranges = []
        for info in sorted(entries, key=lambda i: self.layout.part_offsets[i.index]):
            lo = self.layout.part_offsets[info.index]
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], lo + info.shard_size)
            else:
                ranges.append((lo, lo + info.shard_size))
        return ranges

    def finish(self) -> None:
        """End of backward: reduce what is left (on every rank alike) and wait for every reduction."""
        self.order.finish(self._reduce_bucket, lambda flags: self.coll.all_reduce(flags, op="max"))
        self.reductions.finish()

    def zero(self) -> None:
        """Every bucket is reduced in each backward, so a parameter's first result overwrites its shard."""
        self._grad.release()
        self._unwritten = set(self.by_index)
