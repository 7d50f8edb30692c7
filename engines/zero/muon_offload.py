"""Muon's offloaded step in two parts, a mixin of :class:`~.muon.MuonPartitionOptimizer`.

While backward runs, :meth:`OffloadedMuonStep.step_slice` prepares each slice on the host (Adam elements stepped,
Muon elements' momentum and update written into kept round buffers); after it, :meth:`~OffloadedMuonStep.finish_step`
sends the rounds to the device, orthogonalizes them there and applies them as they come back. docs/zero-muon.md,
"Offload".
"""

from __future__ import annotations

import torch

from .muon_plan import clip, gaps


class OffloadedMuonStep:
    """The two-part step; uses the optimizer's rounds, pieces, buffers and transfer (see MuonPartitionOptimizer)."""

    def begin_step(self) -> None:
        super().begin_step()
        if self.kept_buffers:
            bufs = self._round_buffers()
            for buf, holes in zip(bufs, self._holes, strict=True):  # after last step's results: zeros again
                for lo, hi in holes:
                    buf[lo:hi].zero_()

    def _round_buffers(self) -> list[torch.Tensor]:
        """The kept round buffers (host memory from the partition's allocator: pinned or registered where the
        accelerator can, so their copies to and from the device are asynchronous DMA) and their holes."""
        if self._buffers is None:
            self._buffers, self._holes = [], []
            for rnd, pieces in zip(self.rounds, self.round_pieces, strict=True):
                n = self.coll.world * rnd.chunk
                self._buffers.append(self._alloc(n, self.buffer_dtype))
                self._holes.append(gaps(self._covered(rnd, pieces), n))
        return self._buffers

    @torch.no_grad()
    def step_slice(self, grad: torch.Tensor, lo: int, hi: int) -> None:
        """Prepare elements ``[lo, hi)`` of the step begun by :meth:`begin_step` (the offloaded step, while
        backward runs): the Adam elements are stepped, the Muon elements' momentum and update written into the
        round buffers and their weights decayed. :meth:`finish_step` does the rest."""
        adam, rounds = self._slice_plan(lo, hi)
        self._adam_step(grad, adam)
        bufs = self._round_buffers()
        for rnd, pieces, buf in zip(self.rounds, rounds, bufs, strict=True):
            self._fill(pieces, grad, buf, rnd.chunk)
            self._decay(pieces)

    def slice_done(self, lo: int, hi: int) -> bool:
        """Whether elements ``[lo, hi)`` are fully stepped once :meth:`step_slice` prepared them (no Muon
        element among them): the engine uploads such a slice at once, the others after :meth:`finish_step`."""
        return not any(self._slice_plan(lo, hi)[1])

    def _slice_plan(self, lo: int, hi: int) -> tuple[list, list]:
        """The Adam pieces by weight decay and the Muon pieces by round inside ``[lo, hi)`` (cached: the
        engine prepares the same slices every step)."""
        plan = self._slices.get((lo, hi))
        if plan is None:
            adam = [(wd, [(a, b) for a, b, _, _ in clip([(a, b, None, 0) for a, b in p], lo, hi)])
                    for wd, p in self.adam_pieces]
            plan = self._slices[(lo, hi)] = (adam, [clip(p, lo, hi) for p in self.round_pieces])
        return plan

    @torch.no_grad()
    def finish_step(self, partitioner=None) -> None:
        """Orthogonalize and apply the prepared step: each round's buffer goes to the device, its matrices are
        orthogonalized there, and it comes back into the same host buffer (copies off the compute stream, see
        :mod:`.muon_transfer`); the host applies a round while the device works on the next. With
        ``partitioner``, each of its upload chunks starts uploading as soon as the last round with elements
        in it is applied."""
        last = self._last_rounds(partitioner)
        bufs = self._round_buffers()
        in_flight: list[tuple[int, torch.Tensor, object]] = []
        for r, (rnd, buf, (send, ready)) in enumerate(zip(self.rounds, bufs, self._transfer.up(bufs),
                                                          strict=True)):
            self._transfer.join(ready)
            full = self._orthogonalized(rnd, send)
            in_flight.append((r, buf, self._transfer.down(buf, full)))
            if len(in_flight) == 2:
                self._apply_landed(*in_flight.pop(0), last, partitioner)
        for args in in_flight:
            self._apply_landed(*args, last, partitioner)

    def _last_rounds(self, partitioner) -> dict[int, list[tuple[int, int]]]:
        """``{round: the partitioner's upload chunks whose last Muon elements that round applies}``."""
        if partitioner is None:
            return {}
        if self._chunk_rounds is None:
            self._chunk_rounds = {}
            for lo, hi in partitioner.upload_chunks():
                touched = [r for r, p in enumerate(self.round_pieces) if clip(p, lo, hi)]
                if touched:
                    self._chunk_rounds[(lo, hi)] = max(touched)
        out: dict[int, list[tuple[int, int]]] = {}
        for chunk, r in self._chunk_rounds.items():
            out.setdefault(r, []).append(chunk)
        return out

    def _apply_landed(self, r: int, buf: torch.Tensor, event, last, partitioner) -> None:
        if event is not None:
            event.synchronize()
        self._apply(self.round_pieces[r], buf, self.rounds[r].chunk)
        for lo, hi in last.get(r, ()):
            partitioner.upload(lo, hi)
