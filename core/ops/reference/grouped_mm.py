"""Grouped matmul for expert layers: rows sorted by expert, one weight per expert."""

from __future__ import annotations

import torch

from ...errors import OpArgumentError
from .. import offsets as known_offsets


def check_grouped_mm_shapes(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> None:
    """Validate what needs no look at the offsets' values (no synchronisation).

    ``x`` is [tokens, in], ``weight`` [experts, in, out], ``offsets`` the cumulative
    end row of each expert (int32 or int64, non-decreasing, last <= tokens).
    """
    if x.dim() != 2 or weight.dim() != 3:
        raise OpArgumentError(f"grouped_mm: x must be 2-D and weight 3-D, got {x.dim()}-D and {weight.dim()}-D")
    if x.shape[1] != weight.shape[1]:
        raise OpArgumentError(f"grouped_mm: x has {x.shape[1]} features but weight expects {weight.shape[1]}")
    if offsets.dim() != 1 or offsets.numel() != weight.shape[0]:
        raise OpArgumentError(
            f"grouped_mm: offsets must be 1-D with one entry per expert ({weight.shape[0]}), "
            f"got shape {tuple(offsets.shape)}"
        )
    if offsets.dtype not in (torch.int32, torch.int64):
        raise OpArgumentError(f"grouped_mm: offsets must be int32 or int64, got {offsets.dtype}")
    if x.dtype != weight.dtype:
        raise OpArgumentError(f"grouped_mm: x is {x.dtype} but weight is {weight.dtype}")


def check_grouped_mm_args(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Validate and return ``offsets`` as int64 on ``x``'s device (shapes, dtypes and the offsets' values)."""
    check_grouped_mm_shapes(x, weight, offsets)
    off = offsets.to(torch.int64)
    last_offset(off, x.shape[0])
    return off


def last_offset(off: torch.Tensor, rows: int) -> int:
    """Check the offsets' values and return the last one: one read to the host (the only synchronisation) at
    every call, none for offsets marked valid by construction and unchanged since (:mod:`polyaccel.ops.offsets`)."""
    if not off.numel():
        return 0
    last = known_offsets.known_last(off, rows)
    return _checked_on_host(off, rows) if last is None else last


def _checked_on_host(off: torch.Tensor, rows: int) -> int:
    host = off.cpu()
    if bool((host[1:] < host[:-1]).any()) or int(host[0]) < 0:
        raise OpArgumentError("grouped_mm: offsets must be non-decreasing and non-negative")
    last = int(host[-1])
    if last > rows:
        raise OpArgumentError(f"grouped_mm: last offset {last} exceeds the {rows} rows of x")
    return last


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped matmul for expert layers; returns a new `[tokens, out]` tensor of `x`'s dtype.

    Called as `fn(x, weight, offsets)`. `x` is `[tokens, in]` with the rows sorted by
    expert, `weight` is `[experts, in, out]` of `x`'s dtype, and `offsets` (int32 or int64,
    one per expert, non-decreasing, the last at most `tokens`) is the end row of each
    expert: expert `e` owns rows `offsets[e-1]:offsets[e]` (from 0 for the first). Then

        out[rows of e] = x[rows of e] @ weight[e]
        out[offsets[-1]:] = 0

    Experts may own no rows. Offsets are read as 64-bit, so row counts past 2**31 work.
    Differentiable with respect to `x` and `weight`.
    """
    off = check_grouped_mm_args(x, weight, offsets).tolist()
    outs = []
    start = 0
    for e, end in enumerate(off):
        outs.append(x[start:end] @ weight[e])
        start = end
    tail = x.shape[0] - start
    if tail:
        outs.append(x.new_zeros(tail, weight.shape[2]))
    if not outs:
        return x.new_zeros(x.shape[0], weight.shape[2])
    return torch.cat(outs, dim=0)
