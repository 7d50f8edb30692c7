"""The owner's Newton-Schulz on its chunk of a round buffer, in place: one op call per :class:`~.muon_plan.Batch`.

:func:`~.muon_plan.plan_rounds` lays out the matrices of one batch key next to each other, so a batch is one
view of the chunk in the wide orientation the iteration runs in (a tall batch as the transposed view): no
gathering copy for a batch of wide row-major blocks, one transposing copy for the others; the result is copied
back through that view (no split, re-joined heads or per-matrix copies). The operations per matrix are
:func:`~polyaccel.ops.reference.muon.orthogonalized_update`'s.
"""

from __future__ import annotations

import torch
from polyaccel import ops
from polyaccel.ops.reference import muon as ref_muon

from .muon_plan import Batch


def wide_blocks(chunk: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``batch``'s blocks as a view of ``chunk`` in the wide orientation: ``(n, r, c)`` for row-major blocks
    (``n`` blocks over all its matrices), ``(k, h, r, c)`` for ``k`` matrices split by columns into ``h``
    blocks each; the last two dims transposed where the blocks are tall."""
    region = chunk[batch.offset:batch.offset + batch.numel]
    kind = batch.key[0]
    if kind == "rows":
        _, r, c = batch.key
        blocks = region.view(-1, r, c)
    elif kind == "cols":
        _, h, r, c = batch.key
        blocks = region.view(len(batch.matrices), r, h, c).permute(0, 2, 1, 3)
    else:
        raise ValueError(f"a batch of kind {kind!r} is not orthogonalized in place")
    return blocks.mT if blocks.shape[-2] > blocks.shape[-1] else blocks


def orthogonalize_batches(chunk: torch.Tensor, batches: list[Batch], mcfg) -> None:
    """Newton-Schulz of every matrix of ``batches`` (whole or per head block), written back into ``chunk``: per
    batch the iteration's input (:func:`~polyaccel.ops.reference.muon.ns_input`, a plain cast, none where the
    chunk holds ``ns_dtype`` already), made contiguous where the view is not, one ``newton_schulz`` call and one
    copy into the batch's view."""
    for b in batches:
        view = wide_blocks(chunk, b)
        x = ref_muon.ns_input(view, mcfg.ns_dtype, mcfg.eps)
        # a batch of tall or column-split blocks is strided: materialized (one copy, the transposition the
        # iteration needs anyway) so the op reads the contiguous batch the previous gathering copy made, and
        # rounds alike (a host GEMM of a transposed operand rounds differently in float32)
        x = x.reshape(-1, *x.shape[-2:]).contiguous()
        out = ops.newton_schulz(x, steps=mcfg.ns_steps, coefficients=mcfg.ns_coefficients, eps=mcfg.eps)
        view.copy_(out.view(view.shape))
