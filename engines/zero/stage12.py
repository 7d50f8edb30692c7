"""Stages 1 and 2: replicated 16-bit parameters in one flat buffer, partitioned fp32 master and state.

Gradients are reduce-scattered bucket by bucket (see :class:`~.partition.FlatLayout` for
why a bucket's reduce-scatter lands exactly in each rank's partition). Stage 2 does it from
per-parameter post-accumulate hooks during every backward, in the rank-independent order of
:class:`~.bucket_order.BucketOrder`, and drops each gradient once it is copied into its
bucket; stage 1 keeps full gradients in ``param.grad`` until the
accumulation boundary and reduces them there, except at one micro-step per boundary, where
there is nothing to accumulate and it reduces during backward like stage 2. After the
optimizer step each rank writes its updated slice into the flat buffer and one
``all_gather_into_tensor`` per bucket rebuilds the parameters in place.
"""

from __future__ import annotations

import torch

from .bucket_order import BucketOrder
from .host_step import OverlapError, overlap_message
from .partition import FlatLayout, GradientPartition
from .partitioner import Partitioner, PartitionSetup
from .split_partition import host_cut, split_allocator, warn_if_coarse


class FlatPartitioner(Partitioner):
    """Stage 1 or 2 (``setup.config.stage``) over one process group's parameters ``entries``."""

    def __init__(self, entries: list[tuple[str, torch.nn.Parameter]], *, coll, setup: PartitionSetup):
        super().__init__(coll, setup)
        cfg = setup.config
        self.stage = cfg.stage
        self.reductions = self.reduce_scatter(self._settle, setup)
        # stage 1 with one micro-step per boundary has nothing to accumulate: it reduces in backward like
        # stage 2
        self.reduce_in_backward = cfg.stage == 2 or cfg.gradient_accumulation_steps == 1
        self._flatten(entries)
        self._partition_master(setup)
        self._bucket_at = {b.part_offset: b.index for b in self.layout.buckets}
        self._uploaded: dict[int, torch.Tensor] = {}  # bucket -> its updated slice on the device, this step
        self.on_settle = None  # called with a bucket's master ranges once its gradient is on its way to them
        if self.reduce_in_backward:
            for i, p in enumerate(self.params):
                if p.numel():
                    hook = p.register_post_accumulate_grad_hook(lambda p, i=i: self._on_grad(i, p))
                    self._hooks.append(hook)

    def _flatten(self, entries) -> None:
        """Lay the parameters out in one flat buffer (reverse registration order: roughly backward's, so
        buckets fill one after another) and make each parameter a view of its slice."""
        ordered = list(reversed(entries))
        self.params = [p for _, p in ordered]
        self.layout = lay = FlatLayout([n for n, _ in ordered], [tuple(p.shape) for p in self.params],
                                       self.world, self.bucket_size)
        self.flat = torch.zeros(lay.padded_total, dtype=self.compute_dtype, device=self.device)
        with torch.no_grad():
            for p, off, n in zip(self.params, lay.offsets, lay.numels, strict=True):
                self.flat[off:off + n].copy_(p.detach().reshape(-1))
                p.data = self.flat[off:off + n].view(p.shape)

    def _partition_master(self, setup: PartitionSetup) -> None:
        """This rank's master partition (a copy of its slice of the flat buffer), the gradient partition and
        the order in which buckets complete."""
        lay, master_dtype = self.layout, setup.master_dtype
        ratio = setup.placement.optimizer.ratio
        if ratio < 1:  # the buckets that land last stay on the device (see split_partition)
            cut = host_cut([b.part_offset for b in lay.buckets], lay.partition_size, ratio)
            warn_if_coarse(ratio, cut, lay.partition_size,
                           f"the partition's {len(lay.buckets)} gradient bucket(s) of reduce_bucket_size "
                           f"{setup.config.reduce_bucket_size}; lower reduce_bucket_size for a finer split")
            self.alloc_master = split_allocator(setup.alloc_master, self.device, lay.partition_size, cut)
        self.master = self.alloc_master(lay.partition_size, master_dtype)
        self.master.copy_(lay.partition_of(self.flat, self.rank).to(self.master.device, master_dtype))
        self._grad = GradientPartition(self.alloc_master, lay.partition_size,
                                       setup.grad_dtype or master_dtype, self.device)
        self._unwritten = set(range(len(lay.buckets)))
        self._buffers: dict[int, torch.Tensor] = {}
        members = [[] for _ in lay.buckets]
        for i, ks in enumerate(lay.param_buckets):
            if self.params[i].numel():
                for k in ks:
                    members[k].append(i)
        self.order = BucketOrder(members)

    # ----------------------------------------------------------- reduction
    def _buffer(self, k: int) -> torch.Tensor:
        buf = self._buffers.get(k)
        if buf is None:
            buf = torch.zeros(self.layout.buckets[k].length, dtype=self.compute_dtype, device=self.device)
            self._buffers[k] = buf
        return buf

    def _on_grad(self, i: int, p: torch.nn.Parameter) -> None:
        if self.on_settle is not None and self.order.would_reopen(i):
            raise OverlapError(overlap_message(self.layout.names[i]))
        g = p.grad.detach().reshape(-1)
        for k in self.layout.param_buckets[i]:
            po, bo, n = self.layout.overlap(i, k)
            self._buffer(k)[bo:bo + n].add_(g[po:po + n])
        p.grad = None
        if self.eager:
            for k in self.order.arrive(i):
                self._reduce(k)

    def _reduce(self, k: int) -> None:
        buf = self._buffer(k)
        del self._buffers[k]
        b = self.layout.buckets[k]
        if self.world == 1:  # the sum over one rank
            buf.div_(self.divisor)
            self._settle(k, buf)
            return
        out = torch.empty(b.chunk(self.world), dtype=self.compute_dtype, device=self.device)
        self.reductions.launch(k, out, buf)

    def _settle(self, k: int, out: torch.Tensor) -> None:
        b = self.layout.buckets[k]
        fresh = k in self._unwritten  # the first gradient since zero_grad overwrites: no zeroing, no addition
        self._unwritten.discard(k)
        self.transfer.add_later(self.grad[b.part_offset:b.part_offset + out.numel()], out, self.grad, fresh)
        if self.on_settle is not None:
            self.on_settle([(b.part_offset, b.part_offset + out.numel())])

    def end_backward(self) -> None:
        """After each backward (stage 2): reduce what the hooks left (unused params, leftovers)."""
        if not self.reduce_in_backward:
            return
        self.order.finish(self._reduce, lambda flags: self.coll.all_reduce(flags, op="max"))
        self.reductions.finish()

    def reduce_at_boundary(self) -> None:
        """At the accumulation boundary (stage 1): reduce the full gradients bucket by bucket."""
        if self.reduce_in_backward:
            return
        for k in range(len(self.layout.buckets)):
            buf = self._buffer(k)
            for i, p in enumerate(self.params):
                if p.grad is None or k not in self.layout.param_buckets[i]:
                    continue
                po, bo, n = self.layout.overlap(i, k)
                buf[bo:bo + n].copy_(p.grad.detach().reshape(-1)[po:po + n])
            self._reduce(k)
        self.reductions.finish()
        for p in self.params:
            p.grad = None

    def release_training_state(self) -> None:
        """Drop the master partition and the gradient partition (the engine is being destroyed)."""
        self.master = None
        self._grad.release()

    def zero_grad(self) -> None:
        """Every bucket is reduced in each accumulation window, so its first result overwrites the
        partition."""
        self._grad.release()
        self._unwritten = set(range(len(self.layout.buckets)))
        for p in self.params:
            p.grad = None

    # ------------------------------------------------------------ write-back
    def upload_chunks(self) -> list[tuple[int, int]]:
        """Ranges of the master partition that :meth:`upload` takes, one per bucket, in bucket order."""
        return [(b.part_offset, b.part_offset + b.chunk(self.world)) for b in self.layout.buckets]

    @torch.no_grad()
    def upload(self, lo: int, hi: int) -> None:
        """Start copying the updated master slice ``[lo, hi)`` (one bucket's) to the device; the bucket is
        all-gathered by :meth:`publish`. At world size 1 the slice is the bucket: it goes straight home."""
        k = self._bucket_at[lo]
        b = self.layout.buckets[k]
        if self.world == 1:
            dst = self.flat[b.start:b.start + b.length]
        else:
            dst = torch.empty(hi - lo, dtype=self.compute_dtype, device=self.device)
        self._uploaded[k] = dst
        self.transfer.upload([(dst, self.master[lo:hi])])

    @torch.no_grad()
    def publish(self) -> None:
        """Upload what :meth:`upload` has not, then all-gather every bucket into the flat buffer in place."""
        if not self._uploaded:
            self.transfer.start_upload(self.layout.partition_size, self.compute_dtype)
        for lo, hi in self.upload_chunks():
            if self._bucket_at[lo] not in self._uploaded:
                self.upload(lo, hi)
        works = []
        if self.world > 1:
            for b in self.layout.buckets:
                src = self._uploaded[b.index]
                work = self.coll.all_gather(self.flat[b.start:b.start + b.length], src, async_op=True)
                works.append((work, src))
        for work, _src in works:  # the source stays referenced until its gather is done
            if work is not None:
                work.wait()
        self._uploaded.clear()

    def full_params(self) -> dict[str, torch.Tensor]:
        return self.layout.unflatten(self.flat)

    def device_param_elements(self) -> int:
        return self.flat.numel()
