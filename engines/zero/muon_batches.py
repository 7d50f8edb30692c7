"""The owner's Newton-Schulz on its chunk of a round buffer, in place: one op call per :class:`~.muon_plan.Batch`.

:func:`~.muon_plan.plan_rounds` lays out the matrices of one batch key next to each other, so a batch is one
view of the chunk: no gathering copy for row-major blocks (whole matrices, tall or wide, and row-split heads),
one for column-split heads; the result is copied back through that view (no split, transposes, re-joined heads
or per-matrix copies). The operations per matrix are
:func:`~polyaccel.ops.reference.muon.orthogonalized_update`'s.
"""

from __future__ import annotations

import torch
from polyaccel import ops
from polyaccel.ops.reference import muon as ref_muon

from .muon_plan import Batch


def blocks_of(chunk: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``batch``'s blocks as a view of ``chunk``: ``(n, r, c)`` for row-major blocks (``n`` blocks over all its
    matrices, contiguous), ``(k, h, r, c)`` for ``k`` matrices split by columns into ``h`` blocks each
    (strided: a block's rows are ``c`` of a matrix's ``h * c`` columns)."""
    region = chunk[batch.offset:batch.offset + batch.numel]
    kind = batch.key[0]
    if kind == "rows":
        _, r, c = batch.key
        return region.view(-1, r, c)
    if kind == "cols":
        _, h, r, c = batch.key
        return region.view(len(batch.matrices), r, h, c).permute(0, 2, 1, 3)
    raise ValueError(f"a batch of kind {kind!r} is not orthogonalized in place")


def orthogonalize_batches(chunk: torch.Tensor, batches: list[Batch], mcfg) -> None:
    """Newton-Schulz of every matrix of ``batches`` (whole or per head block), written back into ``chunk``: per
    batch the iteration's input (:func:`~polyaccel.ops.reference.muon.ns_input`, a plain cast, none where the
    chunk holds ``ns_dtype`` already), one ``newton_schulz`` call and one copy into the batch's view. The op
    gets the blocks in their own orientation (it iterates a tall batch as its transpose, which its builder
    may do without a transposing copy), column-split blocks gathered by one copy."""
    for b in batches:
        view = blocks_of(chunk, b)
        x = ref_muon.ns_input(view, mcfg.ns_dtype, mcfg.eps)
        x = x.reshape(-1, *x.shape[-2:])  # a view of row-major blocks; column-split ones: one copy
        out = ops.newton_schulz(x, steps=mcfg.ns_steps, coefficients=mcfg.ns_coefficients, eps=mcfg.eps)
        view.copy_(out.view(view.shape))
