"""Muon stepped during backward with the partition on the device, a mixin of :class:`~.muon.MuonPartitionOptimizer`.

With one rank in the partition group every Muon matrix is this rank's, whole. When nothing in the step needs
the whole gradient (the engine's conditions for an overlapped step: one micro-step a boundary, no clipping, no
fp16 loss scale), each bucket's slice is stepped as its gradient settles: its Adam elements at once, its Muon
elements' momentum and update into a buffer of their matrix, and each matrix whose last element has arrived
is orthogonalized and applied right away. A backward bound by the host leaves the device idle between its
kernels; the Newton-Schulz products fill those gaps instead of running after backward.

The numbers are the step-after-backward's: the same operations on each element, each matrix orthogonalized
on its own (only the batches the matrices travel in differ). docs/zero-muon.md, "In backward".
"""

from __future__ import annotations

import torch

from .muon_plan import gaps


class InBackwardMuonStep:
    """The step in slices on the device; uses the optimizer's matrices, pieces and element-wise passes."""

    @property
    def steps_in_backward(self) -> bool:
        """Whether the engine may step this partition slice by slice as backward settles its gradient: on the
        device (no kept host buffers), one rank, no matrix assembled over a tensor group, not switched off
        (``optimizer.params.step_in_backward``)."""
        return (not self.kept_buffers and self.mcfg.step_in_backward and self.coll.world == 1
                and all(m.tp is None for m in self.matrices))

    def begin_step(self) -> None:
        super().begin_step()
        #: matrix index -> (its update buffer, elements written this step), for matrices begun, not applied
        self._open: dict[int, tuple[torch.Tensor, int]] = {}
        self._stepped: list[tuple[int, int]] = []

    @torch.no_grad()
    def step_slice(self, grad: torch.Tensor, lo: int, hi: int) -> None:
        """Step elements ``[lo, hi)``: Adam elements at once, Muon elements into their matrices' buffers, and
        every matrix completed by them orthogonalized and applied."""
        if self.kept_buffers:
            super().step_slice(grad, lo, hi)
            return
        adam, rounds = self._slice_plan(lo, hi)
        self._adam_step(grad, adam)
        pieces = [p for r in rounds for p in r]
        dsts, complete = [], []
        for a, b, m, elem in pieces:
            buf, written = self._open.get(m.index) or (
                torch.empty(m.numel, dtype=self.buffer_dtype, device=self.master.device), 0)
            dsts.append(buf[elem:elem + b - a])
            self._open[m.index] = (buf, written + b - a)
            if written + b - a == m.numel:
                complete.append(m)
        if pieces:
            self._momentum_update(pieces, grad, dsts)
        if complete:
            self._orthogonalize_and_apply(complete)
        self._stepped.append((lo, hi))

    def _orthogonalize_and_apply(self, matrices) -> None:
        from .muon import orthogonalize_many

        updates = [self._open.pop(m.index)[0].view(m.shape) for m in matrices]
        done = orthogonalize_many(updates, [m.head_split for m in matrices], self.mcfg)
        self.orthogonalized += len(matrices)
        pieces, sources = [], []
        for m, o in zip(matrices, done, strict=True):
            flat = o.reshape(-1)  # a tall matrix's result is a transposed view
            for a, b, _, elem in self._pieces_of(m):
                pieces.append((a, b, m, elem))
                sources.append(flat[elem:elem + b - a])
        self._apply_updates(pieces, sources)

    def _pieces_of(self, m) -> list[tuple]:
        """This rank's pieces of matrix ``m`` (at one rank: the whole matrix, in one or more buckets)."""
        by_matrix = getattr(self, "_by_matrix", None)
        if by_matrix is None:
            by_matrix = self._by_matrix = {}
            for pieces in self.round_pieces:
                for p in pieces:
                    by_matrix.setdefault(p[2].index, []).append(p)
        return by_matrix[m.index]

    def slice_done(self, lo: int, hi: int) -> bool:
        """Whether ``[lo, hi)`` is fully stepped: in backward, once no matrix with elements in it waits for
        elements of another slice (the rest are written back with the step's last uploads)."""
        if self.kept_buffers:
            return super().slice_done(lo, hi)
        return not any(m.index in self._open for r in self._slice_plan(lo, hi)[1] for _, _, m, _ in r)

    @torch.no_grad()
    def finish_step(self, partitioner=None) -> None:
        """After backward: step whatever no settled bucket covered (every bucket settles in backward, so normally
        nothing)."""
        if self.kept_buffers:
            super().finish_step(partitioner)
            return
        for lo, hi in gaps(sorted(self._stepped), self.master.numel()):
            self.step_slice(partitioner.grad, lo, hi)
        if self._open:
            names = sorted(m.name for m in self.matrices if m.index in self._open)
            raise RuntimeError(f"Muon matrices {names} were not complete at the end of the step")


__all__ = ["InBackwardMuonStep"]
