"""Muon under ZeRO: element-wise momentum on each rank's partition, each matrix orthogonalized whole, once.

Muon's update of a weight matrix is the Newton-Schulz orthogonalization of its (Nesterov)
momentum, a function of the *whole* matrix; ZeRO spreads a matrix's elements over ranks (stages
1/2 cut the flat buffer evenly, so a matrix straddles partitions; stage 3 shards every parameter).
One step here:

1. Every rank updates the momentum of its own Muon elements (``buf.lerp_(g, 1 - momentum)``, then
   ``u = g.lerp(buf, momentum)`` with Nesterov, ``buf`` without) and steps its Adam elements with
   ``fused_adam`` and the ``adam_*`` settings, one call per weight decay.
2. Each Muon matrix has one **owner** rank (:func:`plan_rounds`: balanced by Newton-Schulz flops,
   deterministic, the same on every rank). Matrices are processed in **rounds** whose gather buffer
   holds at most ``gather_bucket_size`` elements over all ranks (a matrix larger than that gets a
   round of its own size): each rank writes its pieces of ``u`` into a zeroed buffer laid out as one
   equal chunk per owner, a reduce-scatter hands every owner its chunk, now holding its matrices
   whole (a sum with zeros is exact), the owner orthogonalizes them (whole or per head block; with
   tensor parallelism, after assembling the matrix over the tensor group), and an all-gather of the
   chunks brings every rank the results for its pieces.
3. Every rank applies ``p = p * (1 - lr * wd) - lr * scale * O`` to its Muon elements.

The step is torch.optim.Muon's per matrix (and Adam's per element), so the engine equals the
single-process optimizer to rounding; in float64, exactly up to reduction order.

Optimizer state: ``exp_avg`` holds Adam's first moment on the Adam elements and Muon's momentum
buffer on the Muon elements (both an exponential average of the gradient, with their own
coefficient), ``exp_avg_sq`` Adam's second moment (zero on Muon elements). So the state is as large
as AdamW's and checkpoints re-partition it to any layout like any other state.

Under optimizer offload the partition, the momentum and the element-wise work stay on the host;
the gather buffer goes to the device, where the owner orthogonalizes (Newton-Schulz is matrix
products: the device's job), and comes back. The offloaded step does not overlap backward (it
needs whole matrices).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from polyaccel import ops
from polyaccel.errors import ConfigError
from polyaccel.ops.reference import muon as ref_muon
from polyaccel.parallel import get_layout

from .optimizer import PartitionOptimizer
from .partition import FlatLayout


# ------------------------------------------------------------------ which parameters Muon steps
def choose_params(model: torch.nn.Module, names: list[str], muon_cfg) -> dict:
    """``{name: MuonChoice}`` for the trainable ``names``, by the project's one rule
    (:func:`polyaccel.muon_params.choose_muon_params`) with the config's ``per_head``, ``muon_params`` and
    ``adam_params``; a pattern it cannot honour is a :class:`ConfigError` naming the config key."""
    from polyaccel.muon_params import MuonParamsError, choose_muon_params

    try:
        found = choose_muon_params(model, per_head=muon_cfg.per_head, muon=muon_cfg.muon_params,
                                   adam=muon_cfg.adam_params)
    except MuonParamsError as exc:
        raise ConfigError(f"optimizer.params (muon_params / adam_params / per_head): {exc}") from exc
    return {n: found[n] for n in names}


# ------------------------------------------------------------------ where each matrix's elements are
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


@dataclass
class Round:
    chunk: int  # elements per rank
    matrices: list[Matrix]


def _flops(shape) -> int:
    m, n = shape
    return m * n * min(m, n)


def plan_rounds(matrices: list[Matrix], world: int, cap: int) -> list[Round]:
    """Give each matrix an owner rank and a round; rounds hold at most ``cap`` buffer elements over all ranks.

    Largest matrices (by Newton-Schulz flops of the orthogonalized shape) first; each goes into the first
    round where some owner's chunk still has room, to the owner with the least work so far (ties: lowest
    rank). The decisions use the orthogonalized (full) shapes only, so every rank of the data group and
    every rank of a tensor group decide alike. A round's chunk is the fullest owner's local elements."""
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
        for m in rnd.matrices:
            m.offset = fill[m.owner]
            fill[m.owner] += m.numel
        rnd.chunk = max(fill) if fill else 0
    return rounds


# ------------------------------------------------------------------ the orthogonalization
def orthogonalize(u: torch.Tensor, head_split, mcfg) -> torch.Tensor:
    """Newton-Schulz of one matrix, whole or per head block, in ``ns_dtype``, back in ``u``'s dtype: the
    reference's :func:`~polyaccel.ops.reference.muon.orthogonalized_update`, with the iteration through the
    registry's ``newton_schulz`` (the device's fastest builder)."""
    blocks = ref_muon.split_heads(u, head_split)
    if mcfg.ns_dtype != torch.float16:  # float16 is cast inside newton_schulz, after the scaling
        blocks = blocks.to(mcfg.ns_dtype)
    out = ops.newton_schulz(blocks, steps=mcfg.ns_steps, coefficients=mcfg.ns_coefficients, eps=mcfg.eps)
    return ref_muon.join_heads(out, head_split, u.shape).to(u.dtype)


# ------------------------------------------------------------------ the optimizer
class MuonPartitionOptimizer(PartitionOptimizer):
    """Muon (with auxiliary Adam) on one partition group's flat master partition; see the module docstring.

    ``layout``: the group's partition layout; ``coll``: its partition group's collectives; ``choices``:
    ``{name: Choice}``; ``weight_decays``: the ``param_groups`` decays by name; ``params``: the group's
    ``(name, parameter)`` entries (their tensor-parallel layouts); ``tensor_coll``: the tensor group's
    collectives (None without tensor parallelism); ``comm_device``: where the gather buffers live.
    """

    def __init__(self, cfg, master, alloc, *, layout, coll, choices, weight_decays, params, comm_device,
                 tensor_coll=None, gather_cap: int):
        super().__init__(cfg, master, alloc)
        self.mcfg = cfg.muon
        self.coll, self.tensor_coll, self.comm_device = coll, tensor_coll, comm_device
        rank, world = coll.rank, coll.world
        by_name = dict(params)
        self.matrices: list[Matrix] = []
        index_of = {}
        for i, name in enumerate(layout.names):
            c = choices[name]
            if not c.muon or layout.numels[i] == 0:
                continue
            p = by_name[name]
            split = get_layout(p).split
            tp = split if (split is not None and split.dim == "tensor" and tensor_coll is not None
                           and tensor_coll.world > 1 and self.mcfg.tensor_parallel == "gather") else None
            m = Matrix(i, name, tuple(layout.shapes[i]), c.head_split, tp,
                       weight_decays.get(name, cfg.weight_decay))
            if tp is not None and m.head_split is not None and m.head_split[0] == tp.axis:
                block = m.shape[tp.axis] // m.head_split[1]  # the local head count, as the full matrix's
                m.head_split = (tp.axis, tp.full_length // block)
            blk = ref_muon.split_heads(torch.empty(m.full_shape(), device="meta"), m.head_split).shape
            m.lr_scale = ref_muon.muon_lr_scale(blk, self.mcfg.lr_adjustment)
            index_of[i] = len(self.matrices)
            self.matrices.append(m)
        self.rounds = plan_rounds(self.matrices, world, gather_cap)
        #: this rank's Muon pieces by round: (lo, hi, matrix, first element)
        self.round_pieces: list[list[tuple[int, int, Matrix, int]]] = [[] for _ in self.rounds]
        adam: dict[float, list[tuple[int, int]]] = {}
        for lo, hi, i, elem in pieces_of(layout, rank):
            if i in index_of:
                m = self.matrices[index_of[i]]
                self.round_pieces[m.round].append((lo, hi, m, elem))
            else:
                wd = weight_decays.get(layout.names[i], self.mcfg.adam_weight_decay)
                adam.setdefault(wd, []).append((lo, hi))
        self.adam_pieces = list(adam.items())
        #: how many matrices this rank orthogonalized (its owner's share), over all steps
        self.orthogonalized = 0

    @property
    def steps_in_slices(self) -> bool:
        return False  # whole matrices: the step is one piece

    @property
    def adam_lr(self) -> float:
        """The auxiliary Adam's lr, scaled with the Muon lr (a schedule's ``set_lr`` moves both alike)."""
        base = self.cfg.lr
        return self.mcfg.adam_lr * (self.lr / base) if base > 0 else self.mcfg.adam_lr

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        self.begin_step()
        self._adam_step(grad)
        for rnd, pieces in zip(self.rounds, self.round_pieces, strict=True):
            self._round(rnd, pieces, grad)

    def _adam_step(self, grad: torch.Tensor) -> None:
        mc = self.mcfg
        for wd, pieces in self.adam_pieces:
            ops.fused_adam([self.master[a:b] for a, b in pieces], [grad[a:b] for a, b in pieces],
                           [self.state["exp_avg"][a:b] for a, b in pieces],
                           [self.state["exp_avg_sq"][a:b] for a, b in pieces],
                           lr=self.adam_lr, beta1=mc.adam_betas[0], beta2=mc.adam_betas[1], eps=mc.adam_eps,
                           weight_decay=wd, step=self.step_count, adam_w_mode=True, bias_correction=True)

    def _round(self, rnd: Round, pieces, grad: torch.Tensor) -> None:
        """Momentum and ``u`` of this rank's pieces, the matrices to their owners, orthogonalized, applied."""
        mc, world, dtype = self.mcfg, self.coll.world, self.master.dtype
        c = rnd.chunk
        send = torch.zeros(world * c, dtype=dtype, device=self.master.device)
        for lo, hi, m, elem in pieces:
            buf, g = self.state["exp_avg"][lo:hi], grad[lo:hi].to(dtype)
            buf.lerp_(g, 1 - mc.momentum)
            dst = send[m.owner * c + m.offset + elem:][:hi - lo]
            if mc.nesterov:
                torch.lerp(g, buf, mc.momentum, out=dst)
            else:
                dst.copy_(buf)
        send = send.to(self.comm_device)
        if world > 1:
            mine = torch.empty(c, dtype=dtype, device=self.comm_device)
            self.coll.reduce_scatter(mine, send)
        else:
            mine = send
        for m in rnd.matrices:
            if m.owner == self.coll.rank:
                view = mine[m.offset:m.offset + m.numel].view(m.shape)
                view.copy_(self._orthogonalized(view, m))
                self.orthogonalized += 1
        if world > 1:
            self.coll.all_gather(send, mine)
        full = send.to(self.master.device)
        lr = self.lr
        for lo, hi, m, elem in pieces:
            o = full[m.owner * c + m.offset + elem:][:hi - lo]
            self.master[lo:hi].mul_(1 - lr * m.weight_decay).add_(o, alpha=-lr * m.lr_scale)

    def _orthogonalized(self, u: torch.Tensor, m: Matrix) -> torch.Tensor:
        """The owner's work on one matrix: assembled over the tensor group first when it is split there."""
        if m.tp is None:
            return orthogonalize(u, m.head_split, self.mcfg)
        tc, sp = self.tensor_coll, m.tp
        longest = max(sp.local_length(r) for r in range(sp.degree))
        other = m.shape[1 - sp.axis]
        rows = (longest, other) if sp.axis == 0 else (other, longest)
        pad = torch.zeros(rows, dtype=u.dtype, device=u.device)
        pad.narrow(sp.axis, 0, u.shape[sp.axis]).copy_(u)
        gathered = torch.empty((tc.world, *rows), dtype=u.dtype, device=u.device)
        tc.all_gather(gathered.view(-1), pad.view(-1))
        pieces = [gathered[r].narrow(sp.axis, 0, sp.local_length(r)) for r in range(tc.world)]
        whole = orthogonalize(sp.assemble(pieces), m.head_split, self.mcfg)
        return sp.piece(whole, tc.rank)
