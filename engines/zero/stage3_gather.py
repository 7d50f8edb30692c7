"""Stage 3's parameter shards and the gathers that make parameters whole (see :mod:`.stage3`).

:class:`ParamGatherer` keeps this rank's shard of every parameter (where the
:class:`~.placement.Placement` says: device or host) and gathers and releases parameters;
:class:`PrefetchTrace` records the order modules run in and issues the next modules' gathers
early, within ``stage3_prefetch_bucket_size`` elements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


class ParamInfo:
    __slots__ = ("name", "param", "shape", "numel", "shard_size", "shard", "persistent", "index", "active",
                 "inflight", "order", "held", "whole")

    def __init__(self, name, param, shard_size, shard, persistent, index, order):
        self.name = name
        self.param = param
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.shard_size = shard_size
        self.shard = shard
        self.persistent = persistent
        self.index = index  # position in the optimizer partition layout, None for frozen params
        self.active = 0
        # gathered by a backward fetch and kept until its gradient has arrived: a recomputation (activation
        # checkpointing) that runs the module again in between must not release it under autograd, which
        # accumulates the gradient into the parameter as it is then
        self.held = False
        self.inflight = None
        self.order = order  # position among all parameters, the same on every rank
        # where the shard is the whole parameter on the device (world size 1): the stored shard, or the
        # master's elements, in the parameter's shape, so that a gather is one cast (see
        # ParamGatherer.gather_in_place)
        self.whole = None


class Gather:
    """One coalesced all-gather of several parameters; materialised on first use."""

    def __init__(self, infos, out, work, inp, uploaded=None):
        self.infos, self.out, self.work, self.inp = infos, out, work, inp
        self.uploaded = uploaded  # host shards still being copied up: the reader's stream waits (a callable)
        self.numel = sum(i.numel for i in infos)
        self.done = False

    def finish(self, world: int) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.uploaded is not None:
            self.uploaded()
            self.uploaded = None
        total = sum(i.shard_size for i in self.infos)
        rows = self.out.view(world, total)
        col = 0
        for info in self.infos:
            s = info.shard_size
            if len(self.infos) == 1:
                full = self.out[:info.numel]
            else:
                full = rows[:, col:col + s].reshape(-1)[:info.numel]
            info.param.data = full.view(info.shape)
            info.inflight = None
            col += s
        self.inp = None
        self.done = True


class ParamGatherer:
    """This rank's shard of every parameter (``trainable`` first, then ``frozen``) and their gathers.

    ``master_piece(info)`` is a trainable parameter's shard of the master partition (a shard the placement
    derives from the master is cast from it where needed); ``agree(row)``, with the schedule check on, agrees
    with every rank on each gather before it is issued (see :mod:`.schedule`)."""

    def __init__(self, trainable, frozen, *, coll, setup, transfer, master_piece: Callable, agree: Callable):
        cfg = setup.config
        self.coll, self.world, self.rank = coll, coll.world, coll.rank
        self.device, self.compute_dtype = setup.device, setup.compute_dtype
        self.transfer = transfer
        self.home = setup.placement.shards
        self.master_piece = master_piece
        self.agree = agree
        self.check_schedule = cfg.stage3_check_schedule and self.world > 1
        # world size 1 with the shards on the device: each shard is its whole parameter, so a gather is a view
        # or a cast from the master, with no communication to overlap
        self.in_place = self.home.in_place(self.world)
        self._shard_parameters(trainable, frozen, cfg.stage3_param_persistence_threshold)

    def _shard_parameters(self, trainable, frozen, threshold: int) -> None:
        """Keep this rank's shard of every parameter; empty ``param.data`` except for persistent parameters
        (at most ``threshold`` elements)."""
        world, rank, compute_dtype, device = self.world, self.rank, self.compute_dtype, self.device
        # what a released parameter holds: one empty tensor for all (a new one per release is an allocator
        # call)
        self.empty = torch.empty(0, dtype=compute_dtype, device=device)
        self.infos: dict[int, ParamInfo] = {}
        named = list(trainable) + list(frozen)
        sizes = [-(-p.numel() // world) for _, p in named]
        homes = self.home.homes(sizes, compute_dtype)
        for idx, (name, p) in enumerate(named):
            n, s = p.numel(), sizes[idx]
            shard = homes[idx]
            flat = F.pad(p.detach().reshape(-1), (0, s * world - n))
            shard.copy_(flat[rank * s:(rank + 1) * s])
            persistent = n <= threshold or n == 0
            info = ParamInfo(name, p, s, shard, persistent, idx if idx < len(trainable) else None, idx)
            self.infos[id(p)] = info
            if not persistent:
                p.data = self.empty
            elif self.in_place:  # one storage: the shard is the whole parameter
                p.data = shard[:n].view(p.shape)

    def shard(self, info: ParamInfo) -> torch.Tensor:
        """A parameter's shard in the compute dtype: stored, or (the placement derives it: the master
        partition is on the device) cast from the master where it is needed. Keeping a 16-bit copy of every
        trainable shard beside the master would hold 2 more bytes per parameter on the device between uses;
        the cast costs one pass over what a gather sends."""
        if info.shard is not None:
            return info.shard
        return self.master_piece(info).to(self.compute_dtype)

    def launch(self, infos: list[ParamInfo], async_op: bool) -> Gather | None:
        """Start gathering those of ``infos`` that are neither whole nor on their way (in place: done at
        once)."""
        infos = [i for i in infos if i.inflight is None and i.param.numel() != i.numel]
        if not infos:
            return None
        if self.in_place:
            self.gather_in_place(infos)
            return None
        total = sum(i.shard_size for i in infos)
        if self.check_schedule:
            self.agree((infos[0].order, len(infos), total))
        # host shards are copied up beside the compute stream's kernels (event: what the reader waits for)
        inp, event = self.home.stage(self.transfer, [self.shard(i) for i in infos], self.device)
        if self.world == 1:  # the shard is the parameter: nothing to gather
            out, work = inp, None
        else:
            if event is not None:  # the collective reads it in this stream's order
                self.transfer.join(event)
                event = None
            out = torch.empty(total * self.world, dtype=self.compute_dtype, device=self.device)
            work = self.coll.all_gather(out, inp, async_op=async_op)
        uploaded = functools.partial(self.transfer.join, event) if event is not None else None
        g = Gather(infos, out, work, inp, uploaded)
        for i in infos:
            i.inflight = g
        return g

    def gather_in_place(self, infos: list[ParamInfo]) -> None:
        """World size 1 with the shards on the device: each parameter is its whole shard, cast."""
        dtype = self.compute_dtype
        for i in infos:
            i.param.data = i.whole.to(dtype)

    def materialise(self, infos: list[ParamInfo]) -> None:
        self.launch(infos, async_op=False)
        for info in infos:
            if info.inflight is not None:
                info.inflight.finish(self.world)

    def release(self, info: ParamInfo) -> None:
        if info.persistent or info.active > 0 or info.inflight is not None or info.held:
            return
        if info.param.numel():
            info.param.data = self.empty

    def release_all(self) -> None:
        """Finish gathers in flight and release every parameter not persistent: no forward is running (a count
        left over is from a forward that never returned: non-reentrant activation checkpointing stops its
        recomputation early by raising inside the module) and no gradient is awaited."""
        for info in self.infos.values():
            if info.inflight is not None:
                info.inflight.finish(self.world)
            info.active = 0
            info.held = False
            self.release(info)

    def regather_persistent(self) -> None:
        """Gather the persistent trainable parameters again (their shards were just updated)."""
        persistent = [i for i in self.infos.values() if i.persistent and i.index is not None and i.numel]
        if persistent:
            for i in persistent:
                i.param.data = self.empty
            self.materialise(persistent)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered (a collective), as clones by name; released again afterwards."""
        infos = list(self.infos.values())
        self.materialise(infos)
        out = {i.name: i.param.detach().clone() for i in infos}
        for i in infos:
            self.release(i)
        return out

    @torch.no_grad()
    def load_full(self, param, full: torch.Tensor) -> None:
        """Set a (frozen) parameter from its full value: keep this rank's shard of it."""
        info = self.infos[id(param)]
        s = info.shard_size
        flat = F.pad(full.reshape(-1).to(self.compute_dtype), (0, s * self.world - info.numel))
        info.shard.copy_(flat[self.rank * s:(self.rank + 1) * s])
        if param.numel() == info.numel:
            param.data.copy_(full.view(info.shape))

    def device_param_elements(self) -> int:
        """Parameter elements resident on the device now: gathered tensors plus stored device shards."""
        n = sum(i.param.numel() for i in self.infos.values())
        return n + self.home.device_elements([i.shard for i in self.infos.values()])


class PrefetchTrace:
    """The order modules gathered their parameters in during the first iteration; from the second on, the
    next modules' gathers are issued ahead, while at most ``budget`` prefetched elements are outstanding."""

    def __init__(self, model, budget: int):
        self.budget = budget
        self._trace: list[int] = []
        self._done = False
        self._cursor = 0
        self._ahead = 0
        self._outstanding: list[Gather] = []
        self._modules = {id(m): m for m in model.modules()}

    def record(self, module) -> None:
        key = id(module)
        if not self._done:
            if len(self._trace) > 4 * len(self._modules):  # forwards without a backward (eval): start over
                self._trace.clear()
            self._trace.append(key)
            return
        if self._cursor < len(self._trace) and self._trace[self._cursor] == key:
            self._cursor += 1
        else:  # the order changed (dynamic control flow): stop prefetching until re-recorded
            self._cursor = len(self._trace) + 1

    def prefetch(self, module_params: dict, launch: Callable) -> None:
        """Issue gathers (``launch(infos, async_op=True)``) of the parameters ``module_params`` lists for the
        next modules of the trace. ``_ahead`` remembers how far prefetching got, so each trace entry is looked
        at about once per iteration."""
        if not self._done or self.budget <= 0 or self._cursor > len(self._trace):
            return
        self._outstanding = [g for g in self._outstanding if not g.done]
        inflight = sum(g.numel for g in self._outstanding)
        i = max(self._ahead, self._cursor)
        while i < len(self._trace):
            infos = [x for x in module_params[self._trace[i]]
                     if x.inflight is None and x.param.numel() != x.numel]
            need = sum(x.numel for x in infos)
            if inflight + need > self.budget:
                break
            gather = launch(infos, async_op=True) if infos else None
            if gather is not None:
                self._outstanding.append(gather)
                inflight += need
            i += 1
        self._ahead = i

    def end_iteration(self) -> None:
        """After backward: the trace is complete (from the first iteration on) and is followed from its
        start."""
        if self._trace and not self._done:
            self._done = True
        self._cursor = 0
        self._ahead = 0
        self._outstanding.clear()
