"""The owner's Newton-Schulz on its chunk of a round buffer, in place: one op call per :class:`~.muon_plan.Batch`.

:func:`~.muon_plan.plan_rounds` lays out the matrices of one batch key next to each other, so a batch is one
view of the chunk: no gathering copy for row-major blocks (whole matrices, tall or wide, and row-split heads),
one for column-split heads of several matrices; the op writes the result over the blocks (``out=``) where the
buffer holds the iteration's dtype, else one copy writes it back through the view (no split, transposes,
re-joined heads or per-matrix copies). The operations per matrix are
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
    """Newton-Schulz of every matrix of ``batches`` (whole or per head block), written back into ``chunk``.

    Per batch one ``newton_schulz`` call on its blocks in their own orientation (the op iterates a tall batch as
    its transpose; the cuda builder reads and writes it column-major, no transposing copy). Where the chunk holds
    ``ns_dtype`` already and the blocks are one strided batch, the call is ``out=`` the blocks themselves: the
    result replaces them (the cuda builder's last launch writes it: no copy). Else the iteration's input
    (:func:`~polyaccel.ops.reference.muon.ns_input`: a cast, or column-split heads of several matrices
    gathered by one copy) is iterated and one copy writes the result back through the batch's view."""
    for b in batches:
        view = blocks_of(chunk, b)
        x = ref_muon.ns_input(view, mcfg.ns_dtype, mcfg.eps)
        kw = {"steps": mcfg.ns_steps, "coefficients": mcfg.ns_coefficients, "eps": mcfg.eps}
        if x is view:  # no cast: in place where the blocks are one batch
            try:
                blocks = view.view(-1, *view.shape[-2:])
            except RuntimeError:
                blocks = None
            if blocks is not None:
                ops.newton_schulz(blocks, **kw, out=blocks)
                continue
        x = x.reshape(-1, *x.shape[-2:])  # a view, or column-split heads of several matrices: one copy
        view.copy_(ops.newton_schulz(x, **kw).view(view.shape))
