"""Muon under ZeRO: element-wise momentum on each rank's partition, each matrix orthogonalized whole, once.

Muon's update of a matrix is the Newton-Schulz orthogonalization of its momentum, a function of the whole
matrix, while ZeRO spreads a matrix's elements over ranks. So every rank updates the momentum of its own
elements (and steps its Adam elements), each matrix gets one owner rank (:func:`plan_rounds`), a
reduce-scatter hands the owners their matrices whole, the owners orthogonalize, an all-gather brings the
results back, and every rank applies them to its elements. The step equals torch.optim.Muon's to rounding,
the state is AdamW's size, and under offload the host prepares and applies rounds while the device
orthogonalizes. The step, the rounds, the state and offload in detail: docs/zero-muon.md, "One step".
"""

from __future__ import annotations

import torch
from polyaccel import ops
from polyaccel.errors import ConfigError
from polyaccel.ops.reference import muon as ref_muon
from polyaccel.parallel import get_layout

from .muon_batches import orthogonalize_batches
from .muon_offload import OffloadedMuonStep
from .muon_plan import Matrix, Round, gaps, pieces_of, plan_rounds
from .muon_transfer import RoundTransfer
from .optimizer import PartitionOptimizer


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


# ------------------------------------------------------------------ the orthogonalization
def orthogonalize(u: torch.Tensor, head_split, mcfg) -> torch.Tensor:
    """Newton-Schulz of one matrix, whole or per head block, in ``ns_dtype``, back in ``u``'s dtype."""
    return orthogonalize_many([u], [head_split], mcfg)[0]


def orthogonalize_many(us: list[torch.Tensor], head_splits, mcfg) -> list[torch.Tensor]:
    """Newton-Schulz of each matrix in ``us`` (whole or per head block), back in its dtype: the reference's
    :func:`~polyaccel.ops.reference.muon.orthogonalized_update` per matrix, with the iteration through the
    registry's ``newton_schulz`` (the device's fastest builder).

    Blocks go to the op in the wide orientation (the iteration runs there anyway: a tall block is iterated as
    its transpose), all blocks of one wide shape as one batch: a 2816 x 1024 projection and a 1024 x 2816
    one share a call. The iteration is per matrix, so batching changes no result beyond the last bits of
    the products' summation order; one call of many matrices runs near the GEMM rate where one call each is
    bound by launches."""
    blocks = [ref_muon.split_heads(u, s) for u, s in zip(us, head_splits, strict=True)]
    wide: list[tuple[torch.Tensor, bool]] = []
    by_shape: dict[tuple[int, int], list[int]] = {}
    for k, b in enumerate(blocks):
        b3 = b.reshape(-1, *b.shape[-2:])
        tall = b3.shape[-2] > b3.shape[-1]
        w = b3.mT if tall else b3
        wide.append((w, tall))
        by_shape.setdefault(tuple(w.shape[-2:]), []).append(k)
    out: list[torch.Tensor | None] = [None] * len(us)
    for ks in by_shape.values():
        parts = [ref_muon.ns_input(wide[k][0], mcfg.ns_dtype, mcfg.eps) for k in ks]
        batch = parts[0] if len(parts) == 1 else torch.cat(parts)
        done = ops.newton_schulz(batch, steps=mcfg.ns_steps, coefficients=mcfg.ns_coefficients, eps=mcfg.eps)
        for k, o in zip(ks, done.split([p.shape[0] for p in parts]), strict=True):
            o = (o.mT if wide[k][1] else o).reshape(blocks[k].shape)
            out[k] = ref_muon.join_heads(o, head_splits[k], us[k].shape).to(us[k].dtype)
    return out


def _span(buf: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return buf[start:start + n]  # (one slice: the step takes one a piece in each direction)


def buffer_dtype(ns_dtype: torch.dtype, master_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the round buffers: ``ns_dtype`` where the iteration's input is a plain cast of the update
    to a narrower dtype (a cast is element-wise, so done while the update is written it rounds alike) and
    the result, already of ``ns_dtype``, widens exactly; else the master's (float16, whose input is scaled
    to unit norm before the cast, and iterations wider than the master)."""
    if ns_dtype != torch.float16 and ns_dtype.itemsize < master_dtype.itemsize:
        return ns_dtype
    return master_dtype


# ------------------------------------------------------------------ the optimizer
class MuonPartitionOptimizer(OffloadedMuonStep, PartitionOptimizer):
    """Muon (with auxiliary Adam) on one partition group's flat master partition; see the module docstring.

    ``layout``: the group's partition layout; ``coll``: its partition group's collectives; ``choices``:
    ``{name: Choice}``; ``weight_decays``: the ``param_groups`` decays by name; ``params``: the group's
    ``(name, parameter)`` entries (their tensor-parallel layouts); ``tensor_coll``: the tensor group's
    collectives (None without tensor parallelism); ``comm_device``: where the gather buffers live;
    ``accelerator``: the engine's (events for the offloaded step's pipeline; None: it waits copy by copy);
    ``kept_buffers``: whether the round buffers are kept between steps (see :attr:`kept_buffers`).
    """

    def __init__(self, cfg, master, alloc, *, layout, coll, choices, weight_decays, params, comm_device,
                 tensor_coll=None, gather_cap: int, accelerator=None, kept_buffers: bool | None = None):
        super().__init__(cfg, master, alloc)
        self.mcfg = cfg.muon
        self.coll, self.tensor_coll, self.comm_device = coll, tensor_coll, comm_device
        self.accelerator = accelerator
        self.buffer_dtype = buffer_dtype(self.mcfg.ns_dtype, master.dtype)
        rank, world = coll.rank, coll.world
        by_name = dict(params)
        self.matrices: list[Matrix] = []
        index_of = {}
        for i, name in enumerate(layout.names):
            c = choices[name]
            if c.muon and layout.numels[i]:
                index_of[i] = len(self.matrices)
                wd = weight_decays.get(name, cfg.weight_decay)
                shape = tuple(layout.shapes[i])
                self.matrices.append(self._matrix(i, name, shape, c.head_split, by_name[name], wd))
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
        self._alloc = alloc
        self._transfer = RoundTransfer(accelerator, comm_device)
        #: whether the round buffers are kept between steps, allocated by ``alloc`` (by default where
        #: the partition is on the host: the offloaded step, prepared slice by slice, in pinned buffers);
        #: else each round's buffer lives on the partition's device for its round only (one round's memory)
        self.kept_buffers = master.device.type == "cpu" if kept_buffers is None else kept_buffers
        self._buffers: list[torch.Tensor] | None = None  # the offloaded step's round buffers (host, kept)
        self._slices: dict[tuple[int, int], tuple] = {}
        self._scratch_buf: torch.Tensor | None = None
        self._chunk_rounds: dict[tuple[int, int], int] | None = None

    def _matrix(self, i: int, name: str, shape, head_split, p, weight_decay: float) -> Matrix:
        split = get_layout(p).split
        tc = self.tensor_coll
        tp = split if (split is not None and split.dim == "tensor" and tc is not None and tc.world > 1
                       and self.mcfg.tensor_parallel == "gather") else None
        m = Matrix(i, name, shape, head_split, tp, weight_decay)
        if tp is not None and m.head_split is not None and m.head_split[0] == tp.axis:
            block = m.shape[tp.axis] // m.head_split[1]  # the local head count, as the full matrix's
            m.head_split = (tp.axis, tp.full_length // block)
        blk = ref_muon.split_heads(torch.empty(m.full_shape(), device="meta"), m.head_split).shape
        m.lr_scale = ref_muon.muon_lr_scale(blk, self.mcfg.lr_adjustment)
        return m

    def release(self) -> None:
        """Drop the state, the master and the kept buffers (the engine is being destroyed)."""
        super().release()
        self._buffers = self._scratch_buf = None
        self._slices.clear()

    @property
    def steps_in_slices(self) -> bool:
        return False  # whole matrices: a slice is only prepared (defers_apply)

    @property
    def adam_lr(self) -> float:
        """The auxiliary Adam's lr, scaled with the Muon lr (a schedule's ``set_lr`` moves both alike)."""
        base = self.cfg.lr
        return self.mcfg.adam_lr * (self.lr / base) if base > 0 else self.mcfg.adam_lr

    @property
    def defers_apply(self) -> bool:
        """With the partition on the host a sliced step only prepares (Adam, momentum and update into the
        round buffers; the engine overlaps it with backward) and :meth:`finish_step` orthogonalizes and
        applies."""
        return self.kept_buffers

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        self.begin_step()
        if self.kept_buffers:
            self.step_slice(grad, 0, self.master.numel())
            self.finish_step()
            return
        # the rounds first: after backward the device waits for the step's first launch, and a round's first
        # pass is prepared fastest; the Adam pieces (disjoint elements) are prepared while the device orthogonalizes
        for rnd, pieces in zip(self.rounds, self.round_pieces, strict=True):
            send = self._new_buffer(rnd, pieces)
            self._fill(pieces, grad, send, rnd.chunk)
            self._apply(pieces, self._orthogonalized(rnd, send), rnd.chunk)
        self._adam_step(grad, self.adam_pieces)

    # ------------------------------------------------------------ the element-wise passes
    def _adam_step(self, grad: torch.Tensor, adam_pieces) -> None:
        mc = self.mcfg
        for wd, pieces in adam_pieces:
            if not pieces:
                continue
            ops.fused_adam([self.master[a:b] for a, b in pieces], [grad[a:b] for a, b in pieces],
                           [self.state["exp_avg"][a:b] for a, b in pieces],
                           [self.state["exp_avg_sq"][a:b] for a, b in pieces],
                           lr=self.adam_lr, beta1=mc.adam_betas[0], beta2=mc.adam_betas[1], eps=mc.adam_eps,
                           weight_decay=wd, step=self.step_count, adam_w_mode=True, bias_correction=True)

    def _fill(self, pieces, grad: torch.Tensor, send: torch.Tensor, c: int) -> None:
        """Momentum of ``pieces`` and their update ``u`` written into the round buffer ``send`` (in its dtype:
        the update is computed in the master's and rounded once, as a cast after it would round it)."""
        if not pieces:
            return
        mc = self.mcfg
        if self.kept_buffers:
            bufs = [self.state["exp_avg"][lo:hi] for lo, hi, _, _ in pieces]
            dsts = [_span(send, m.owner * c + m.offset + elem, hi - lo) for lo, hi, m, elem in pieces]
            self._host_fill([grad[lo:hi] for lo, hi, _, _ in pieces], bufs, dsts)
            return
        # one pass over all pieces (the device's builder: one launch reading each gradient once): the momentum and
        # the update rounded once into the round buffer
        ops.muon_momentum(grad, self.state["exp_avg"], send, grad_offsets=[lo for lo, _, _, _ in pieces],
                          buffer_offsets=[lo for lo, _, _, _ in pieces],
                          out_offsets=[m.owner * c + m.offset + elem for _, _, m, elem in pieces],
                          lengths=[hi - lo for lo, hi, _, _ in pieces], momentum=mc.momentum, nesterov=mc.nesterov)

    def _host_fill(self, grads, bufs, dsts) -> None:
        """:meth:`_fill` on the host, piece by piece through a kept scratch buffer of the master's dtype: the
        host's kernels make a temporary for every operand or result of another dtype (fresh memory, paged in
        again at every step), the device's convert as they go. The same operations on the same numbers."""
        mc, dtype = self.mcfg, self.master.dtype
        for g, b, d in zip(grads, bufs, dsts, strict=True):
            g32 = g if g.dtype == dtype else self._scratch(g.numel()).copy_(g)
            b.lerp_(g32, 1 - mc.momentum)
            if not mc.nesterov:
                d.copy_(b)
            elif d.dtype == dtype:
                torch.lerp(g32, b, mc.momentum, out=d)
            else:
                d.copy_(torch.lerp(g32, b, mc.momentum, out=self._scratch(g.numel())))

    def _scratch(self, n: int) -> torch.Tensor:
        if self._scratch_buf is None or self._scratch_buf.numel() < n:
            self._scratch_buf = torch.empty(n, dtype=self.master.dtype, device=self.master.device)
        return self._scratch_buf[:n]

    def _apply(self, pieces, full: torch.Tensor, c: int) -> None:
        """``p = p * (1 - lr * wd) - lr * scale * O`` on ``pieces``, ``O`` read from the round buffer ``full``
        (widened to the master's dtype inside the addition: the same numbers as a cast first). With kept
        buffers the decay was applied when the pieces were prepared (:meth:`_decay`): the same two roundings
        in the same order, the first one while backward still runs."""
        lr = self.lr
        if not self.kept_buffers and pieces and full.device == self.master.device:
            # one pass over all pieces (the device's builder: one launch), each piece's decay and scale in a table
            ops.muon_apply(self.master, full, param_offsets=[lo for lo, _, _, _ in pieces],
                           update_offsets=[m.owner * c + m.offset + elem for _, _, m, elem in pieces],
                           lengths=[hi - lo for lo, hi, _, _ in pieces], lr=lr,
                           weight_decays=[m.weight_decay for _, _, m, _ in pieces],
                           lr_scales=[m.lr_scale for _, _, m, _ in pieces])
            return
        apply: dict[tuple[float, float], tuple[list, list]] = {}
        for lo, hi, m, elem in pieces:
            ps, os_ = apply.setdefault((m.weight_decay, m.lr_scale), ([], []))
            ps.append(self.master[lo:hi])
            os_.append(_span(full, m.owner * c + m.offset + elem, hi - lo))
        for (wd, scale), (ps, os_) in apply.items():
            if self.kept_buffers and full.dtype != self.master.dtype:  # on the host: through the scratch
                for p, o in zip(ps, os_, strict=True):
                    p.add_(self._scratch(o.numel()).copy_(o), alpha=-lr * scale)
                continue
            if lr * wd and not self.kept_buffers:  # a factor of exactly 1 changes nothing
                torch._foreach_mul_(ps, 1 - lr * wd)
            torch._foreach_add_(ps, os_, alpha=-lr * scale)

    def _decay(self, pieces) -> None:
        """``p *= 1 - lr * wd`` on the Muon ``pieces`` (the kept buffers' step: see :meth:`_apply`)."""
        lr = self.lr
        by_decay: dict[float, list[torch.Tensor]] = {}
        for lo, hi, m, _ in pieces:
            if lr * m.weight_decay:  # a factor of exactly 1 changes nothing
                by_decay.setdefault(m.weight_decay, []).append(self.master[lo:hi])
        for wd, ps in by_decay.items():
            torch._foreach_mul_(ps, 1 - lr * wd)

    def _new_buffer(self, rnd: Round, pieces) -> torch.Tensor:
        """A round's buffer where the partition is; zeroed where this rank writes nothing (other ranks' pieces
        are summed in by the reduce-scatter: adding zeros is exact)."""
        n = self.coll.world * rnd.chunk
        if gaps(self._covered(rnd, pieces), n):
            return torch.zeros(n, dtype=self.buffer_dtype, device=self.master.device)
        return torch.empty(n, dtype=self.buffer_dtype, device=self.master.device)

    @staticmethod
    def _covered(rnd: Round, pieces) -> list[tuple[int, int]]:
        """Where ``pieces`` go in their round's buffer."""
        at = [m.owner * rnd.chunk + m.offset + e for _, _, m, e in pieces]
        return [(a, a + hi - lo) for a, (lo, hi, _, _) in zip(at, pieces, strict=True)]

    # ------------------------------------------------------------ the owner's part
    def _orthogonalized(self, rnd: Round, send: torch.Tensor) -> torch.Tensor:
        """The round's matrices to their owners (a reduce-scatter of ``send``), orthogonalized there in place
        (:mod:`.muon_batches`: one call per batch of the plan), and back to every rank (an all-gather into
        ``send``'s device copy, returned)."""
        send, mine = self._to_owners(rnd, send)
        owned = [b for b in rnd.batches if b.owner == self.coll.rank]
        orthogonalize_batches(mine, [b for b in owned if b.key[0] != "tp"], self.mcfg)
        for b in owned:
            if b.key[0] == "tp":
                (m,) = b.matrices
                v = mine[m.offset:m.offset + m.numel].view(m.shape)
                v.copy_(self._tensor_parallel_orthogonalized(v, m))
            self.orthogonalized += len(b.matrices)
        if self.coll.world > 1:
            self.coll.all_gather(send, mine)
        return send

    def _to_owners(self, rnd: Round, send: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``send`` on the comm device, and this rank's chunk of the round summed over the ranks (a
        reduce-scatter; ``send`` itself at world size 1)."""
        send = send.to(self.comm_device, non_blocking=True)
        if self.coll.world == 1:
            return send, send
        mine = torch.empty(rnd.chunk, dtype=send.dtype, device=self.comm_device)
        self.coll.reduce_scatter(mine, send)
        return send, mine

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
