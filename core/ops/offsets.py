"""What is known about a grouped op's offsets without reading them from the device.

The grouped ops (``grouped_mm``, ``moe_gate_up``, ``moe_down_combine``) take each group's end row
and must not run a kernel on bad ones (decreasing, negative, past the rows): a wrong group is a
wrong number, not a crash. Checking means reading the offsets to the host, and on an accelerator
that read waits for everything queued before it, so a layer bound by its launches loses the host's
lead over the device once per step.

Only offsets valid by construction skip the read (:func:`mark_complete`): an engine that makes them
so that they cannot be bad says so, e.g. AutoEP's end rows, searched in expert ids that ``topk``
drew from a router's ``E`` columns, made and consumed inside one layer, never handed out. The mark
holds for that tensor object while its version counter is unchanged (an in-place change through
the tensor or a view of it is checked again).

Offsets that were merely *checked* once are checked again at every call: a version counter does not
see every write. A NumPy array from ``.numpy()``, a ``.data`` or ``.detach()`` alias, a tensor
``set_`` to the same storage or a DLPack consumer all write the memory without bumping it, so a
cache of "checked, unchanged since" could hand a kernel a decreasing ``[5, 2]`` it never saw.

One entry is kept: a layer's offsets are made and consumed before the next layer's are made.
"""

from __future__ import annotations

import weakref

import torch

from ..errors import InvalidArgument

#: (weak reference to the marked offsets, their version counter, rows)
_marked: tuple = (None, -1, -1)


def mark_complete(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Record that ``offsets`` are valid end rows of ``rows`` rows that every row belongs to (non-negative,
    non-decreasing, the last equal to ``rows``) by the way the caller made them; returns ``offsets``.

    Only for offsets that cannot be otherwise and that nothing else writes: e.g. ``searchsorted(sorted_ids,
    arange(E), right=True)`` over ``rows`` ids each in ``[0, E)``, consumed by the layer that made them.
    Nothing reads the values to confirm it (that read is what this spares).
    """
    global _marked
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() == 0:
        shape = tuple(offsets.shape) if isinstance(offsets, torch.Tensor) else type(offsets).__name__
        raise InvalidArgument(f"mark_complete: offsets must be a non-empty 1-D tensor, got shape {shape}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise InvalidArgument(f"mark_complete: offsets must be int32 or int64, got {offsets.dtype}")
    _marked = (weakref.ref(offsets), offsets._version, int(rows))
    return offsets


def is_marked(offsets: torch.Tensor) -> bool:
    """Whether ``offsets`` are the tensor marked complete last, unchanged (by version counter) since."""
    ref, version, _ = _marked
    return ref is not None and ref() is offsets and version == offsets._version


def known_last(offsets: torch.Tensor, rows: int) -> int | None:
    """``rows`` if ``offsets`` were marked complete for ``rows`` rows and are unchanged since, else None (read
    and check them)."""
    if is_marked(offsets) and _marked[2] == rows:
        return rows
    return None


__all__ = ["is_marked", "known_last", "mark_complete"]
