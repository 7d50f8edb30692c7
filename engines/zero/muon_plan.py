"""Where Muon's matrices are under ZeRO and who orthogonalizes them: pieces, owners, rounds.

:func:`pieces_of` lists a rank's partition as pieces of parameters; :func:`plan_rounds` gives each
matrix an owner rank and a gather round (see :mod:`.muon` for the step that uses them);
:func:`clip` cuts pieces to a slice of the partition (the offloaded step prepares a bucket's slice
as soon as its gradient has landed).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .partition import FlatLayout


def pieces_of(layout, rank: int) -> list[tuple[int, int, int, int]]:
    """``rank``'s partition as ``(lo, hi, parameter index, first element in the parameter)`` pieces (padding
    left out), for a :class:`~.partition.FlatLayout` or a :class:`~.partition.ShardLayout`."""
    out = []
    n_names = len(layout.names)
    if isinstance(layout, FlatLayout):
        starts = [b.part_offset for b in layout.buckets]
        for lo, hi, i in layout.param_ranges(rank):
            if i >= n_names:
                continue
            k = bisect.bisect_right(starts, lo) - 1
            flat_start, _ = layout.owned(k, rank)
            elem = flat_start + (lo - layout.buckets[k].part_offset) - layout.offsets[i]
            out.append((lo, hi, i, elem))
        return out
    for lo, hi, i in layout.param_ranges(rank):
        s = layout.shard_sizes[i]
        first = rank * s
        valid = max(0, min(hi - lo, layout.numels[i] - first))
        if valid:
            out.append((lo, lo + valid, i, first))
    return out


def clip(pieces: list[tuple], lo: int, hi: int) -> list[tuple]:
    """The parts of ``(a, b, x, first element, ...)`` pieces inside ``[lo, hi)``, first elements moved."""
    out = []
    for a, b, x, elem, *rest in pieces:
        s, e = max(a, lo), min(b, hi)
        if s < e:
            out.append((s, e, x, elem + s - a, *rest))
    return out


@dataclass
class Matrix:
    """One Muon matrix of a partition group: its place in the rounds and how it is orthogonalized."""

    index: int  # in the layout
    name: str
    shape: tuple[int, int]  # this rank's tensor (a piece of the full matrix under tensor parallelism)
    head_split: tuple[int, int] | None  # of the matrix orthogonalized (the full one when gathered)
    tp: object  # the polyaccel.parallel Split to assemble over the tensor group first, or None
    weight_decay: float
    round: int = 0
    owner: int = 0
    offset: int = 0  # in the owner's chunk of its round
    lr_scale: float = 1.0

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def full_shape(self) -> tuple[int, int]:
        if self.tp is None:
            return self.shape
        s = list(self.shape)
        s[self.tp.axis] = self.tp.full_length
        return tuple(s)


def ns_batch_key(m: Matrix) -> tuple:
    """Which of a round's matrices can go to one Newton-Schulz call as one view of the round buffer: those of
    one key, laid out next to each other in their owner's chunk (:func:`plan_rounds`).

    ``("rows", r, c)``: ``r x c`` row-major blocks (a whole matrix, or a row split into head blocks, which
    are the same bytes as that many whole ``r x c`` matrices); ``("cols", h, r, c)``: a matrix split by
    columns into ``h`` blocks of ``r x c`` (strided inside the matrix); ``("tp", index)``: assembled over the
    tensor group first, alone. The orientation is part of the shape: a tall and a wide matrix differ."""
    if m.tp is not None:
        return ("tp", m.index)
    r, c = m.shape
    dim, heads = m.head_split or (0, 1)
    if dim == 0 or heads == 1:
        return ("rows", r // heads, c)
    return ("cols", heads, r, c // heads)


@dataclass
class Batch:
    """Matrices of one :func:`ns_batch_key` next to each other in their owner's chunk, from ``offset``."""

    owner: int
    offset: int
    key: tuple
    matrices: list[Matrix]

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.matrices)


@dataclass
class Round:
    chunk: int  # elements per rank
    matrices: list[Matrix]
    batches: list[Batch] = field(default_factory=list)  # per owner, in chunk order


def _flops(shape) -> int:
    m, n = shape
    return m * n * min(m, n)


def plan_rounds(matrices: list[Matrix], world: int, cap: int) -> list[Round]:
    """Give each matrix an owner rank and a round; rounds hold at most ``cap`` buffer elements over all ranks.

    Largest matrices (by Newton-Schulz flops of the orthogonalized shape) first; each goes into the first
    round where some owner's chunk still has room, to the owner with the least work so far (ties: lowest
    rank). The decisions use the orthogonalized (full) shapes only, so every rank of the data group and
    every rank of a tensor group decide alike. A round's chunk is the fullest owner's local elements.

    In an owner's chunk the matrices of one :func:`ns_batch_key` lie next to each other (keys in the order of
    their first matrix, matrices in layout order), so each :class:`Batch` is one view of the buffer."""
    per_rank = max(1, cap // max(1, world))
    work = [0] * world
    loads: list[list[int]] = []  # per round, per owner: elements (full shapes) placed
    order = sorted(matrices, key=lambda m: (-_flops(m.full_shape()), m.index))
    for m in order:
        size = m.full_shape()[0] * m.full_shape()[1]
        placed = False
        for r, load in enumerate(loads):
            room = [o for o in range(world) if load[o] + size <= per_rank]
            if room:
                o = min(room, key=lambda o: (work[o], o))
                m.round, m.owner = r, o
                placed = True
                break
        if not placed:
            loads.append([0] * world)
            m.round, m.owner = len(loads) - 1, min(range(world), key=lambda o: (work[o], o))
        loads[m.round][m.owner] += size
        work[m.owner] += _flops(m.full_shape())
    rounds = [Round(0, []) for _ in loads]
    for m in sorted(matrices, key=lambda m: m.index):
        rounds[m.round].matrices.append(m)
    for rnd in rounds:
        fill = [0] * world
        grouped: dict[tuple[int, tuple], list[Matrix]] = {}
        for m in rnd.matrices:
            grouped.setdefault((m.owner, ns_batch_key(m)), []).append(m)
        for (owner, key), ms in grouped.items():
            rnd.batches.append(Batch(owner, fill[owner], key, ms))
            for m in ms:
                m.offset = fill[owner]
                fill[owner] += m.numel
        rnd.chunk = max(fill) if fill else 0
    return rounds


def gaps(covered: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """The ranges of ``[0, total)`` that no ``(lo, hi)`` in ``covered`` covers."""
    out, at = [], 0
    for lo, hi in sorted(covered):
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < total:
        out.append((at, total))
    return out
