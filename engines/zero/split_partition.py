"""Partial optimizer offload (``offload_optimizer.ratio`` < 1): one flat partition kept in two places.

With the optimizer offloaded, the host steps each gradient bucket as soon as it lands, under
the rest of backward (:mod:`.host_step`), at the host's memory bandwidth. Where that work
outlasts backward the step waits for it; a ratio below 1 gives the device a share of it. The
share that stays on the device is the parameters whose gradients arrive last (the first layers
and the embedding): their host step could never overlap backward, and the next forward needs
them first. The host keeps the rest, whose step overlaps backward. In stages 1 and 2 those
parameters are the tail of the flat partition (it is laid out in reverse registration order)
and the cut lies on a bucket boundary; in stage 3 they are its head (registration order) and
the cut lies between parameters.

:class:`SplitPartition` stands for a master, moment or gradient partition of ``numel``
elements held as ``low`` (elements ``[0, cut)``) and ``high`` (``[cut, numel)``), one of them on
the host and the other on the device. It offers what the engine does with a whole partition —
slicing within one place, zeroing, copying in, a host copy for checkpoints, its squared norm —
and nothing else, so whole-tensor arithmetic on it fails loudly instead of computing on half of it.
"""

from __future__ import annotations

import warnings

import torch


class SplitPartition:
    def __init__(self, low: torch.Tensor, high: torch.Tensor, device_low: bool = False):
        if low.dtype != high.dtype or low.dim() != 1 or high.dim() != 1:
            raise ValueError("a split partition is two flat tensors of one dtype")
        self.low, self.high = low, high
        self.cut = low.numel()
        #: whether ``low`` is the device part (stage 3) rather than ``high`` (stages 1 and 2)
        self.device_low = device_low
        self.host_part = high if device_low else low
        self.shape = torch.Size([low.numel() + high.numel()])
        self.dtype = low.dtype
        #: where the partition is said to live (a gradient partition there is kept between steps)
        self.device = self.host_part.device

    def numel(self) -> int:
        return self.shape[0]

    def element_size(self) -> int:
        return self.low.element_size()

    def data_ptr(self) -> int:
        """Where element 0 would be if the host part spanned the whole partition: the host part's address less
        its start, so that an address in the host part, less this, over the element size, is a partition offset."""
        start = self.cut if self.device_low else 0
        return self.host_part.data_ptr() - start * self.element_size()

    @property
    def host_elements(self) -> int:
        return self.host_part.numel()

    def __getitem__(self, index: slice) -> torch.Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a split partition is sliced by a contiguous range only")
        lo, hi, _ = index.indices(self.numel())
        hi = max(lo, hi)
        if hi <= self.cut:
            return self.low[lo:hi]
        if lo >= self.cut:
            return self.high[lo - self.cut:hi - self.cut]
        raise IndexError(f"range [{lo}, {hi}) crosses the cut at {self.cut} between host and device parts")

    def ranges(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` cut where the partition changes place (one or two ranges)."""
        if lo < self.cut < hi:
            return [(lo, self.cut), (self.cut, hi)]
        return [(lo, hi)]

    def on_device(self, lo: int) -> bool:
        """Whether element ``lo`` is kept in the device part."""
        return (lo < self.cut) == self.device_low

    def zero_(self) -> SplitPartition:
        self.low.zero_()
        self.high.zero_()
        return self

    def copy_(self, src: torch.Tensor) -> SplitPartition:
        if src.shape != self.shape:
            raise ValueError(f"cannot copy {tuple(src.shape)} into a split partition of {tuple(self.shape)}")
        self.low.copy_(src[:self.cut])
        self.high.copy_(src[self.cut:])
        return self

    def detach(self) -> SplitPartition:
        return self

    def cpu(self) -> torch.Tensor:
        """Both parts in one host tensor (what a checkpoint stores: it does not depend on the ratio)."""
        return torch.cat([self.low.cpu(), self.high.cpu()])


def ranges(t, lo: int, hi: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of a partition, cut where it changes place."""
    return t.ranges(lo, hi) if isinstance(t, SplitPartition) else [(lo, hi)]


def squared_norm(t) -> torch.Tensor:
    """The float64 squared norm of a partition (a scalar tensor where its host part is)."""
    if isinstance(t, SplitPartition):
        return squared_norm(t.low) + squared_norm(t.high).to(t.low.device)
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


def host_cut(starts: list[int], numel: int, ratio: float, host_first: bool = True) -> int:
    """The boundary nearest a host share of ``ratio``: where a partition is cut between host and device.

    ``starts`` are the offsets where a piece may begin (buckets in stages 1 and 2, parameters in stage 3);
    ``host_first``: the host part is ``[0, cut)``, else ``[cut, numel)``. Ties go to the host (the device
    keeps no more than asked for)."""
    target = ratio * numel if host_first else (1 - ratio) * numel
    host = (lambda b: b) if host_first else (lambda b: numel - b)
    return min([*starts, numel], key=lambda b: (abs(b - target), -host(b)))


#: a realised host share further than this from the configured ratio is worth a warning
COARSE = 0.1


def warn_if_coarse(ratio: float, host: int, numel: int, pieces: str) -> None:
    """Warn when whole pieces (``pieces`` says which, and how to make them finer) put the host's share of
    ``host`` elements far from ``ratio``."""
    share = host / numel if numel else 1.0
    if abs(share - ratio) > COARSE:
        warnings.warn(f"zero_optimization.offload_optimizer.ratio {ratio} rounds to a host share of {share:.2f}: "
                      f"the split falls between {pieces}", stacklevel=2)


def split_allocator(alloc_host, device: torch.device, numel: int, cut: int, device_low: bool = False):
    """``alloc(numel, dtype)`` for the partitions of one partitioner: a :class:`SplitPartition` cut at ``cut``,
    its host part from ``alloc_host`` and its device part on ``device`` (``device_low``: ``[0, cut)`` is the
    device part)."""

    def alloc(n: int, dtype: torch.dtype) -> SplitPartition:
        if n != numel:
            raise ValueError(f"a split partition has {numel} elements, {n} were asked for")
        if device_low:
            return SplitPartition(torch.empty(cut, dtype=dtype, device=device), alloc_host(numel - cut, dtype),
                                  device_low=True)
        return SplitPartition(alloc_host(cut, dtype), torch.empty(numel - cut, dtype=dtype, device=device))

    return alloc
