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
    """Newton-Schulz of one matrix, whole or per head block, in ``ns_dtype``, back in ``u``'s dtype."""
    return orthogonalize_many([u], [head_split], mcfg)[0]


def orthogonalize_many(us: list[torch.Tensor], head_splits, mcfg) -> list[torch.Tensor]:
    """Newton-Schulz of each matrix in ``us`` (whole or per head block), back in its dtype: the reference's
    :func:`~polyaccel.ops.reference.muon.orthogonalized_update` per matrix, with the iteration through the
    registry's ``newton_schulz`` (the device's fastest builder).

    Blocks of one shape go to the op as one batch: the iteration is per matrix, so batching changes no
    result, and one call of many small matrices runs near the GEMM rate where one call each is bound by
    launches."""
    blocks = [ref_muon.split_heads(u, s) for u, s in zip(us, head_splits, strict=True)]
    by_shape: dict[tuple[int, int], list[int]] = {}
    for k, b in enumerate(blocks):
        by_shape.setdefault(tuple(b.shape[-2:]), []).append(k)
    out: list[torch.Tensor | None] = [None] * len(us)
    for shape, ks in by_shape.items():
        parts = [ref_muon.ns_input(blocks[k].reshape(-1, *shape), mcfg.ns_dtype, mcfg.eps) for k in ks]
        batch = parts[0] if len(parts) == 1 else torch.cat(parts)
        done = ops.newton_schulz(batch, steps=mcfg.ns_steps, coefficients=mcfg.ns_coefficients, eps=mcfg.eps)
        for k, o in zip(ks, done.split([p.shape[0] for p in parts]), strict=True):
            o = o.reshape(blocks[k].shape)
            out[k] = ref_muon.join_heads(o, head_splits[k], us[k].shape).to(us[k].dtype)
    return out


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
        """Momentum and ``u`` of this rank's pieces, the matrices to their owners, orthogonalized, applied.

        The element-wise work is one ``torch._foreach_*`` call per kind over all the round's pieces
        (the same operations as one call per piece, in the same order per element)."""
        mc, world, dtype = self.mcfg, self.coll.world, self.master.dtype
        c = rnd.chunk
        send = torch.zeros(world * c, dtype=dtype, device=self.master.device)
        if pieces:
            bufs = [self.state["exp_avg"][lo:hi] for lo, hi, _, _ in pieces]
            grads = [grad[lo:hi].to(dtype) for lo, hi, _, _ in pieces]
            dsts = [send[m.owner * c + m.offset + elem:][:hi - lo] for lo, hi, m, elem in pieces]
            torch._foreach_lerp_(bufs, grads, 1 - mc.momentum)
            if mc.nesterov:
                torch._foreach_copy_(dsts, grads)
                torch._foreach_lerp_(dsts, bufs, mc.momentum)  # = lerp(g, buf, momentum)
            else:
                torch._foreach_copy_(dsts, bufs)
        send = send.to(self.comm_device)
        if world > 1:
            mine = torch.empty(c, dtype=dtype, device=self.comm_device)
            self.coll.reduce_scatter(mine, send)
        else:
            mine = send
        owned = [m for m in rnd.matrices if m.owner == self.coll.rank]
        views = [mine[m.offset:m.offset + m.numel].view(m.shape) for m in owned]
        whole = [(v, m) for v, m in zip(views, owned, strict=True) if m.tp is None]
        if whole:
            done = orthogonalize_many([v for v, _ in whole], [m.head_split for _, m in whole], self.mcfg)
            torch._foreach_copy_([v for v, _ in whole], done)
        for v, m in zip(views, owned, strict=True):
            if m.tp is not None:
                v.copy_(self._tensor_parallel_orthogonalized(v, m))
        self.orthogonalized += len(owned)
        if world > 1:
            self.coll.all_gather(send, mine)
        full = send.to(self.master.device)
        lr = self.lr
        apply: dict[tuple[float, float], tuple[list, list]] = {}
        for lo, hi, m, elem in pieces:
            ps, os_ = apply.setdefault((m.weight_decay, m.lr_scale), ([], []))
            ps.append(self.master[lo:hi])
            os_.append(full[m.owner * c + m.offset + elem:][:hi - lo])
        for (wd, scale), (ps, os_) in apply.items():
            torch._foreach_mul_(ps, 1 - lr * wd)
            torch._foreach_add_(ps, os_, alpha=-lr * scale)

    def _tensor_parallel_orthogonalized(self, u: torch.Tensor, m: Matrix) -> torch.Tensor:
        """The owner's work on a matrix split over the tensor group: assembled there first."""
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
