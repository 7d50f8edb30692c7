"""Where every parameter element lives once it is partitioned over ``world`` ranks.

Two layouts, both pure bookkeeping (no tensors are allocated here):

:class:`FlatLayout` (stages 1 and 2). The trainable parameters are concatenated, in
reverse registration order (roughly the order backward produces their gradients), into one
flat vector padded to ``world * P`` elements with ``P = ceil(total / world)``. The flat
vector is cut into buckets of ``world * b`` elements (``b = reduce_bucket_size // world``,
the last bucket shorter), and **rank r owns the r-th ``1/world`` slice of every bucket**.
That is exactly what ``reduce_scatter_tensor`` over a bucket hands to each rank and what
``all_gather_into_tensor`` into a bucket reads from each rank, so gradients are reduced
bucket by bucket during backward with no padding traffic, parameters are re-gathered in
place after the step, and every rank holds exactly ``P`` optimizer-state elements.

:class:`ShardLayout` (stage 3). Each parameter is flattened, padded to a multiple of
``world`` and split evenly: rank r holds elements ``[r*s, (r+1)*s)`` with
``s = ceil(numel / world)`` (the last ranks hold the padding). A rank's optimizer partition
is the concatenation of its shards of the trainable parameters (``sum(s_i)`` elements).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int  # in the flat vector
    length: int  # multiple of world
    part_offset: int  # where each rank's slice of this bucket starts in its partition

    def chunk(self, world: int) -> int:
        return self.length // world


class FlatLayout:
    """Flat, bucket-interleaved partitioning of a list of parameters (stages 1 and 2)."""

    def __init__(self, names: list[str], shapes: list[tuple[int, ...]], world: int, bucket_size: int):
        self.names = list(names)
        self.shapes = [tuple(s) for s in shapes]
        self.numels = [int(torch.Size(s).numel()) for s in self.shapes]
        self.world = int(world)
        self.offsets = []
        off = 0
        for n in self.numels:
            self.offsets.append(off)
            off += n
        self.total = off
        self.partition_size = ceil_div(self.total, self.world) if self.total else 0
        self.padded_total = self.partition_size * self.world
        self.bucket_chunk = max(1, min(int(bucket_size) // self.world, self.partition_size or 1))
        self.buckets: list[Bucket] = []
        start = 0
        while start < self.padded_total:
            length = min(self.bucket_chunk * self.world, self.padded_total - start)
            self.buckets.append(Bucket(len(self.buckets), start, length, start // self.world))
            start += length
        # which buckets each parameter touches, and how many parameter elements each bucket holds
        self.param_buckets: list[list[int]] = []
        self.bucket_fill = [0] * len(self.buckets)
        for off, n in zip(self.offsets, self.numels, strict=True):
            ks = []
            if n:
                first = off // (self.bucket_chunk * self.world)
                last = (off + n - 1) // (self.bucket_chunk * self.world)
                ks = list(range(first, last + 1))
            self.param_buckets.append(ks)
            for k in ks:
                b = self.buckets[k]
                self.bucket_fill[k] += min(off + n, b.start + b.length) - max(off, b.start)

    def overlap(self, i: int, k: int) -> tuple[int, int, int]:
        """Param ``i`` in bucket ``k``: (offset in the param, offset in the bucket, length)."""
        off, n, b = self.offsets[i], self.numels[i], self.buckets[k]
        lo, hi = max(off, b.start), min(off + n, b.start + b.length)
        return lo - off, lo - b.start, hi - lo

    def owned(self, k: int, rank: int) -> tuple[int, int]:
        """Rank's slice of bucket ``k`` as (start in the flat vector, length)."""
        b = self.buckets[k]
        c = b.chunk(self.world)
        return b.start + rank * c, c

    def segment_ids(self, rank: int) -> torch.Tensor:
        """For each element of ``rank``'s partition, the index of its parameter (``len(names)`` for padding)."""
        flat_ids = torch.full((self.padded_total,), len(self.names), dtype=torch.long)
        for i, (off, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            flat_ids[off:off + n] = i
        return self.partition_of(flat_ids, rank)

    def param_ranges(self, rank: int) -> list[tuple[int, int, int]]:
        """``rank``'s partition as ``(lo, hi, parameter index)`` ranges in order, covering it exactly (index
        ``len(names)`` for padding): what :meth:`segment_ids` says, without an index per element."""
        out = []
        for k in range(len(self.buckets)):
            start, c = self.owned(k, rank)
            base = self.buckets[k].part_offset
            pos, end = start, start + c
            i = max(0, bisect.bisect_right(self.offsets, start) - 1)
            while pos < end and i < len(self.names):
                lo, hi = max(pos, self.offsets[i]), min(end, self.offsets[i] + self.numels[i])
                if hi > lo:
                    out.append((base + lo - start, base + hi - start, i))
                    pos = hi
                if self.offsets[i] + self.numels[i] >= end:
                    break
                i += 1
            if pos < end:
                out.append((base + pos - start, base + c, len(self.names)))
        return out

    def partition_of(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's partition (``P`` elements) cut out of a full padded flat vector."""
        parts = [flat[s:s + c] for s, c in (self.owned(k, rank) for k in range(len(self.buckets)))]
        return torch.cat(parts) if parts else flat[:0].clone()

    def full_from_partitions(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Reassemble the padded flat vector from every rank's partition (index = rank)."""
        if len(parts) != self.world:
            raise ValueError(f"need {self.world} partitions, got {len(parts)}")
        pieces = []
        for b in self.buckets:
            c = b.chunk(self.world)
            pieces.extend(p[b.part_offset:b.part_offset + c] for p in parts)
        return torch.cat(pieces) if pieces else parts[0][:0].clone()

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: flat[off:off + n].view(shape).clone()
                for name, off, n, shape in zip(self.names, self.offsets, self.numels, self.shapes, strict=True)}

    def flatten(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        flat = torch.zeros(self.padded_total, dtype=dtype)
        for name, off, n in zip(self.names, self.offsets, self.numels, strict=True):
            flat[off:off + n] = tensors[name].reshape(-1).to(dtype)
        return flat


class ShardLayout:
    """Per-parameter even sharding with tail padding (stage 3)."""

    def __init__(self, names: list[str], shapes: list[tuple[int, ...]], world: int):
        self.names = list(names)
        self.shapes = [tuple(s) for s in shapes]
        self.numels = [int(torch.Size(s).numel()) for s in self.shapes]
        self.world = int(world)
        self.shard_sizes = [ceil_div(n, self.world) for n in self.numels]
        self.part_offsets = []
        off = 0
        for s in self.shard_sizes:
            self.part_offsets.append(off)
            off += s
        self.partition_size = off
        self.total = sum(self.numels)

    def segment_ids(self, rank: int) -> torch.Tensor:
        ids = torch.empty(self.partition_size, dtype=torch.long)
        for i, (off, s, n) in enumerate(zip(self.part_offsets, self.shard_sizes, self.numels, strict=True)):
            valid = max(0, min(s, n - rank * s))
            ids[off:off + valid] = i
            ids[off + valid:off + s] = len(self.names)
        return ids

    def param_ranges(self, rank: int) -> list[tuple[int, int, int]]:
        """``rank``'s partition as ``(lo, hi, parameter index)`` ranges in order: each parameter's shard (its
        tail padding included)."""
        return [(off, off + s, i) for i, (off, s) in enumerate(zip(self.part_offsets, self.shard_sizes, strict=True))
                if s]

    def partition_of(self, tensors: dict[str, torch.Tensor], rank: int, dtype: torch.dtype) -> torch.Tensor:
        part = torch.zeros(self.partition_size, dtype=dtype)
        for name, off, s, n in zip(self.names, self.part_offsets, self.shard_sizes, self.numels, strict=True):
            flat = tensors[name].reshape(-1)
            lo, hi = min(rank * s, n), min((rank + 1) * s, n)
            part[off:off + hi - lo] = flat[lo:hi].to(dtype)
        return part

    def unflatten_partitions(self, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        if len(parts) != self.world:
            raise ValueError(f"need {self.world} partitions, got {len(parts)}")
        out = {}
        rows = zip(self.names, self.part_offsets, self.shard_sizes, self.numels, self.shapes, strict=True)
        for name, off, s, n, shape in rows:
            full = torch.cat([p[off:off + s] for p in parts])[:n]
            out[name] = full.view(shape).clone()
        return out


class GradientPartition:
    """The gradient partition, held only while it holds something.

    Allocated (zeroed) when first used, normally when the first reduced bucket lands in backward, and
    dropped by :meth:`release` after the step when it lives on the compute device. A step's device peak
    comes early in backward (the logits and their gradient) before any bucket has landed, so a partition
    kept from one step to the next would add its whole size to that peak. On the host (optimizer offload)
    it stays: pinned memory is slow to allocate and host memory is not what runs out. So does one split
    between host and device (a partial offload: it says it lives where its host part is).
    """

    def __init__(self, alloc, numel: int, dtype: torch.dtype, device: torch.device):
        self._alloc, self._numel, self._dtype, self._device = alloc, numel, dtype, device
        self._tensor: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self._alloc(self._numel, self._dtype)
            self._tensor.zero_()
        return self._tensor

    def release(self) -> None:
        if self._tensor is not None and self._tensor.device == self._device:
            self._tensor = None
