"""What is known about a grouped op's offsets without reading them from the device.

The grouped ops (``grouped_mm``, ``moe_gate_up``, ``moe_down_combine``) take each group's end row
and must not run a kernel on bad ones (decreasing, negative, past the rows): a wrong group is a
wrong number, not a crash. Checking means reading the offsets to the host, and on an accelerator
that read waits for everything queued before it, so a layer bound by its launches loses the host's
lead over the device once per step. Two things spare the read, both tied to one tensor object and
its version counter (an in-place change, or any other tensor, is checked again):

- the offsets checked last: a MoE layer's GEMMs share one offsets tensor, checked once;
- offsets valid by construction (:func:`mark_complete`): an engine that makes them so that they
  cannot be bad says so, e.g. AutoEP's end rows, searched in expert ids that ``topk`` drew from a
  router's ``E`` columns.

One entry is kept: a layer's offsets are made and consumed before the next layer's are made.
"""

from __future__ import annotations

import weakref

import torch

from ..errors import InvalidArgument

#: (weak reference to the offsets, their version counter, rows, their last offset)
_known: tuple = (None, -1, -1, 0)


def mark_complete(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Record that ``offsets`` are valid end rows of ``rows`` rows that every row belongs to (non-negative,
    non-decreasing, the last equal to ``rows``) by the way the caller made them; returns ``offsets``.

    Only for offsets that cannot be otherwise: e.g. ``searchsorted(sorted_ids, arange(E), right=True)`` over
    ``rows`` ids each in ``[0, E)``. Nothing reads the values to confirm it (that read is what this spares).
    """
    if offsets.dim() != 1 or offsets.numel() == 0:
        raise InvalidArgument(f"mark_complete: offsets must be a non-empty 1-D tensor, got shape "
                              f"{tuple(offsets.shape)}")
    remember(offsets, rows, rows)
    return offsets


def remember(offsets: torch.Tensor, rows: int, last: int) -> None:
    """Record the result of a check of ``offsets`` against ``rows`` rows (their last offset ``last``)."""
    global _known
    _known = (weakref.ref(offsets), offsets._version, rows, last)


def known_last(offsets: torch.Tensor, rows: int) -> int | None:
    """The last offset of ``offsets`` if they were checked (or marked) for ``rows`` rows and are unchanged since,
    else None."""
    ref, version, known_rows, last = _known
    if ref is not None and ref() is offsets and version == offsets._version and known_rows == rows:
        return last
    return None
