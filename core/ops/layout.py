"""Staging tensors whose layout a flat-memory kernel cannot take, for op builders.

The op contract hands builders the caller's tensors as they are: transposed, sliced, with a
storage offset, a read-only gradient expanded from a smaller one. A kernel that walks
``numel()`` elements from each operand's ``data_ptr()`` (torch's fused Adam, a Triton or
vendor multi-tensor kernel) is right only when the operands of one entry line up element
for element in memory. :func:`stage` finds the entries where they do not, runs those on
dense copies, and :meth:`Staged.copy_back` writes the results into the caller's tensors.
Entries that already fit cost one ``is_contiguous()`` per tensor and are passed as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel()`` consecutive memory locations from ``data_ptr()``, each once."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_dense_layout(entry: Sequence[torch.Tensor]) -> bool:
    """Whether the operands of one entry are dense with equal strides: a flat kernel pairs them correctly."""
    first = entry[0]
    if first.is_contiguous():
        return all(t.is_contiguous() for t in entry[1:])
    strides = first.stride()
    return is_dense(first) and all(t.stride() == strides for t in entry[1:])


def all_contiguous(entry: Sequence[torch.Tensor]) -> bool:
    """Whether every operand of one entry is contiguous (for kernels that take nothing else)."""
    return all(t.is_contiguous() for t in entry)


@dataclass
class Staged:
    """Operand lists to hand the kernel, and the (caller's tensor, dense copy) pairs to write back."""

    lists: tuple[list, ...]
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def copy_back(self) -> None:
        """Write the kernel's results from the dense copies into the caller's tensors (stream-ordered, no sync)."""
        for original, copy in self.pending:
            original.copy_(copy)
        self.pending.clear()


def stage(lists: Sequence[Sequence[torch.Tensor]], written: frozenset[int] | set[int],
          fits: Callable[[Sequence[torch.Tensor]], bool] = same_dense_layout) -> Staged:
    """``lists`` with every non-contiguous operand of an entry that does not ``fit`` replaced by a dense copy.

    ``written`` are the indices of the lists the kernel writes; only their copies are written
    back. Lists that need nothing are returned as given (no copies, nothing to write back).
    """
    if all(t.is_contiguous() for lst in lists for t in lst):
        return Staged(tuple(lists))
    n = len(lists[0])
    if any(len(lst) != n for lst in lists):
        return Staged(tuple(lists))  # not a valid call: leave it to the builder's own checks to refuse
    out = tuple(list(lst) for lst in lists)
    staged = Staged(out)
    for i in range(n):
        entry = [lst[i] for lst in lists]
        if fits(entry):
            continue
        for li, t in enumerate(entry):
            if not t.is_contiguous():
                copy = t.contiguous()
                out[li][i] = copy
                if li in written:
                    staged.pending.append((t, copy))
    return staged


__all__ = ["Staged", "all_contiguous", "is_dense", "same_dense_layout", "stage"]
