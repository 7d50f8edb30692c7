"""When a gradient bucket may be reduced: the same order on every rank, whatever the local gradients.

Every rank must issue the same collectives in the same order. During backward, gradients
arrive in an order that depends on the rank's data (an MoE expert that got no token here
produces no gradient here, a data-dependent branch skips parameters), so "reduce a bucket
as soon as it is complete here" lets ranks disagree about which bucket the n-th
reduce-scatter carries: a size mismatch when buckets differ in length, silently mixed
gradients when they do not.

The rule, for buckets numbered 0..K-1 in a layout every rank shares:

- during backward, bucket k is reduced only when it is complete *and* every bucket before
  it has been reduced, so the early reductions are a prefix 0..j of the bucket order on
  every rank (j may differ; nothing after a gap is reduced early). Where other collectives
  run during backward (stage 3's gathers), the ranks exchange their j at each gather and
  reduce the prefix complete everywhere (:meth:`ready`, :meth:`take`), so every rank's
  reductions fall between the same gathers;
- at the end of backward the rest, j+1..K-1, are reduced in order: parameters that got no
  gradient contribute zeros;
- a gradient that arrives after its bucket was reduced (a parameter whose gradient hook
  fires twice in one backward, as with reentrant activation checkpointing of a shared
  weight) reopens the bucket; the ranks agree on the reopened buckets with one small
  all-reduce and reduce those again, in order.

So each rank issues exactly K reductions per backward, in bucket order, plus the agreement
and one more per reopened bucket, identically everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class BucketOrder:
    """Tracks arrivals of parameter gradients and says which buckets to reduce, and when."""

    def __init__(self, bucket_members: Sequence[Sequence[int]]):
        self._members = [frozenset(m) for m in bucket_members]
        self._buckets_of: dict[int, list[int]] = {}
        for k, members in enumerate(self._members):
            for i in members:
                self._buckets_of.setdefault(i, []).append(k)
        self.reset()

    @property
    def num_buckets(self) -> int:
        return len(self._members)

    def reset(self) -> None:
        self._missing = [set(m) for m in self._members]
        self._next = 0
        self._reopened: set[int] = set()

    def is_reduced(self, k: int) -> bool:
        return k < self._next

    def would_reopen(self, i: int) -> bool:
        """Whether a gradient for parameter ``i`` now would reopen a reduced bucket."""
        return any(k < self._next for k in self._buckets_of.get(i, ()))

    def arrive(self, i: int) -> list[int]:
        """Parameter ``i`` got its gradient; returns the buckets that may be reduced now, in order."""
        self.record(i)
        return self.take(self.ready())

    def record(self, i: int) -> None:
        """Parameter ``i`` got its gradient; reduce nothing yet (see :meth:`ready` and :meth:`take`)."""
        for k in self._buckets_of.get(i, ()):
            if k < self._next:
                self._reopened.add(k)
            else:
                self._missing[k].discard(i)

    def ready(self) -> int:
        """One past the last bucket of the complete prefix here: buckets ``next..ready()-1`` may be reduced.
        Stage 3 exchanges this count and reduces the prefix complete on every rank (see ``schedule``)."""
        j = self._next
        while j < len(self._members) and not self._missing[j]:
            j += 1
        return j

    def take(self, upto: int) -> list[int]:
        """The buckets not reduced yet below ``upto``, in order; they count as reduced from now on."""
        ks = list(range(self._next, upto))
        self._next = max(self._next, upto)
        return ks

    def finish(self, reduce: Callable[[int], None], agree: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """End of backward: ``reduce`` the buckets not reduced yet, in order; then agree on the reopened buckets
        (``agree`` is an all-reduce with max) and reduce those again, in order. Resets for the next backward."""
        for k in range(self._next, len(self._members)):
            reduce(k)
        reopened = sorted(self._reopened)
        if agree is not None and self._members:
            flags = torch.zeros(len(self._members), dtype=torch.int32)
            flags[reopened] = 1
            reopened = agree(flags).nonzero().flatten().tolist()
        for k in reopened:
            reduce(k)
        self.reset()
