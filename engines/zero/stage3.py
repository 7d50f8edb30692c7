"""Stage 3: parameters partitioned too, gathered around each submodule's forward and backward.

Every parameter keeps only its shard (``ceil(numel/world)`` elements, see
:class:`~.partition.ShardLayout`) on the device (or in host memory with ``offload_param``);
``param.data`` is an empty tensor outside the module that uses it. Hooks on every module that
owns a parameter that is not persistent (see below):

- forward pre-hook: gather the module's parameters (one coalesced ``all_gather_into_tensor``
  for those not already present) and, from the second iteration on, prefetch the next modules'
  parameters in the recorded order, within ``stage3_prefetch_bucket_size`` elements (not at
  world size 1 with the shards on the device, where a gather is a view or a cast);
- forward post-hook: release them, and wrap the outputs in an identity autograd function whose
  backward gathers them again before the module's own backward runs. While the model's forward
  runs (the engine installs a saved-tensor hook), a tensor autograd saves that is a view of a
  gathered parameter is kept as a reference to the parameter (:class:`_SavedParam`), so the
  release really frees the gathered storage;
- a post-accumulate-grad hook per trainable parameter: hold its gradient for its reduce
  bucket and release the parameter. Buckets are fixed groups of about ``reduce_bucket_size``
  gathered elements (at world size 1 one parameter each, unless the optimizer is offloaded),
  reduce-scattered into each rank's gradient partition in the rank-independent order of
  :class:`~.bucket_order.BucketOrder`; with peers, at the next agreement of the schedule check
  (or backward fetch, without it), once complete on every rank (see :mod:`.schedule`).

With peers and ``stage3_check_schedule``, every gather, and the end of every forward and
backward, is agreed on first (:class:`~.schedule.GatherSchedule`): ranks whose modules ran
differently all raise :class:`~.leaves.ScheduleMismatch` at once instead of hanging.

Parameters of at most ``stage3_param_persistence_threshold`` elements stay gathered all the
time (their optimizer state is still partitioned; they are re-gathered after each step).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .bucket_order import BucketOrder
from .host_step import OverlapError, overlap_message
from .leaves import find_leaf_modules
from .partition import GradientPartition, ShardLayout
from .partitioner import Partitioner, PartitionSetup
from .schedule import END_BACKWARD, END_FORWARD, GatherSchedule
from .split_partition import host_cut, split_allocator, warn_if_coarse


class _Info:
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
        # where the shard is the whole parameter on the device (world size 1): the stored shard, or the master's
        # elements, in the parameter's shape, so that a gather is one cast (see ShardedParameters._gather_in_place)
        self.whole = None


class _Gather:
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


class _SavedParam:
    """What autograd keeps, during forward, in place of a saved tensor that is (a view of) a gathered
    parameter: the parameter and the view's geometry. Keeping the tensor would keep the gathered storage
    alive after the module's forward has released it (``linear`` saves ``weight.t()``, a view), so every
    layer's gathered weights would stay until its backward. Unpacked in backward, after the module's
    parameters were gathered again, as the same view of the new storage."""

    __slots__ = ("info", "size", "stride", "offset")

    def __init__(self, info, t: torch.Tensor):
        self.info = info
        self.size, self.stride = t.size(), t.stride()
        self.offset = t.storage_offset() - info.param.storage_offset()

    def load(self) -> torch.Tensor:
        p = self.info.param
        if p.numel() != self.info.numel:
            raise RuntimeError(
                f"ZeRO stage 3: backward needs parameter {self.info.name!r}, which is not gathered now; a tensor "
                "saved in forward refers to it outside the backward of the module that owns it. Mark the module "
                "that uses it as a leaf (zero_optimization.stage3_leaf_modules) so it is gathered with its user.")
        return p.detach().as_strided(self.size, self.stride, p.storage_offset() + self.offset)


def unpack_saved(x):
    """The unpack hook that goes with :meth:`ShardedParameters.pack_saved`."""
    return x.load() if isinstance(x, _SavedParam) else x


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner, module, *outputs):
        ctx.owner, ctx.module = owner, module
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner._fetch(ctx.module, backward=True)
        return (None, None) + grads


# Module-level and recursive by name, not nested closures: a closure that calls itself is a reference cycle,
# which would keep every module output it saw (the logits among them) alive until the next garbage collection.
def _tensors_needing_grad(x, found: list) -> list:
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            found.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors_needing_grad(y, found)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors_needing_grad(y, found)
    return found


def _replace_tensors(x, wrapped: dict):
    """``x`` with each tensor whose id is in ``wrapped`` replaced by its wrapped version (dicts in place)."""
    if isinstance(x, torch.Tensor):
        return wrapped.get(id(x), x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_replace_tensors(y, wrapped) for y in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_replace_tensors(y, wrapped) for y in x)
    if isinstance(x, dict):
        for k in list(x.keys()):
            x[k] = _replace_tensors(x[k], wrapped)
        return x
    return x


class ShardedParameters(Partitioner):
    """Stage 3 over one process group's parameters (``trainable`` and, for the first group, ``frozen``); every
    setting comes from ``setup.config`` (see :mod:`.config`), the runtime resources from ``setup``."""

    def __init__(self, model, trainable, frozen, *, coll, setup: PartitionSetup):
        super().__init__(coll, setup)
        cfg = setup.config
        self.prefetch_budget = cfg.stage3_prefetch_bucket_size
        self.offload_param = cfg.offload_param.enabled
        self.offload_optimizer = cfg.offload_optimizer.enabled
        self.check_schedule = cfg.stage3_check_schedule and self.world > 1
        # world size 1 with the shards on the device: each shard is its whole parameter, so a gather is a view or
        # a cast from the master, with no communication to overlap
        self._in_place = self.world == 1 and not self.offload_param
        self._shard_parameters(trainable, frozen, setup.host, cfg.stage3_param_persistence_threshold)
        # with the master partition on the device a shard is cast from it where needed (see _shard)
        self._partition_master(setup, derive_shards=not (self.offload_optimizer or self.offload_param))
        self._hook_modules(model, cfg)
        self._hook_gradients()
        self._init_reduction()
        self._init_trace(model)
        self._init_schedule(model)

    def _shard_parameters(self, trainable, frozen, host, threshold: int) -> None:
        """Keep this rank's shard of every parameter (trainable ones first, in the partition layout); empty
        ``param.data`` except for persistent parameters (at most ``threshold`` elements)."""
        world, rank, compute_dtype, device = self.world, self.rank, self.compute_dtype, self.device
        # what a released parameter holds: one empty tensor for all (a new one per release is an allocator call)
        self._empty = torch.empty(0, dtype=compute_dtype, device=device)
        self.layout = ShardLayout([n for n, _ in trainable], [tuple(p.shape) for _, p in trainable], world)
        self.infos: dict[int, _Info] = {}
        named = list(trainable) + list(frozen)
        sizes = [-(-p.numel() // world) for _, p in named]
        # offloaded shards are views of one host buffer: one allocation at its exact size (see offload.HostBuffers
        # on what a runtime's pinned allocator rounds a block up to) and one registration
        homes = host.empty(sum(sizes), compute_dtype).split(sizes) if self.offload_param else None
        for idx, (name, p) in enumerate(named):
            n, s = p.numel(), sizes[idx]
            if homes is not None:
                shard = homes[idx]
            else:
                shard = torch.empty(s, dtype=compute_dtype, device=device)
            flat = F.pad(p.detach().reshape(-1), (0, s * world - n))
            shard.copy_(flat[rank * s:(rank + 1) * s])
            persistent = n <= threshold or n == 0
            info = _Info(name, p, s, shard, persistent, idx if idx < len(trainable) else None, idx)
            self.infos[id(p)] = info
            if not persistent:
                p.data = self._empty
            elif self._in_place:  # one storage: the shard is the whole parameter
                p.data = shard[:n].view(p.shape)

    def _partition_master(self, setup: PartitionSetup, derive_shards: bool) -> None:
        """The master partition, filled from the trainable shards (dropped when ``derive_shards``), and the
        gradient partition."""
        ratio, size = setup.config.offload_optimizer.ratio, self.layout.partition_size
        if ratio < 1:  # the parameters whose gradients land last (the first registered) stay on the device
            starts = sorted(self.layout.part_offsets)
            cut = host_cut(starts, size, ratio, host_first=False)
            warn_if_coarse(ratio, size - cut, size, "parameters (a large one, such as the embedding, is one piece)")
            self.alloc_master = split_allocator(setup.alloc_master, self.device, size, cut, device_low=True)
        self.master = self.alloc_master(size, setup.master_dtype)
        for info in self.infos.values():
            if info.index is not None:
                off = self.layout.part_offsets[info.index]
                self.master[off:off + info.shard_size].copy_(info.shard)
                if derive_shards:
                    info.shard = None
        if self._in_place:
            for info in self.infos.values():
                source = info.shard if info.shard is not None else self._master_piece(info)
                info.whole = source[:info.numel].view(info.shape)
        self._grad = GradientPartition(self.alloc_master, self.layout.partition_size,
                                       setup.grad_dtype or setup.master_dtype, self.device)

    def _hook_modules(self, model, cfg) -> None:
        """Gather and release hooks on every module (or leaf subtree) that owns a non-persistent parameter; note
        which module gathers each parameter."""
        self._module_params: dict[int, list[_Info]] = {}
        self.leaves = find_leaf_modules(model, cfg.stage3_leaf_modules, cfg.stage3_module_granularity_threshold)
        inside = {id(m) for leaf in self.leaves.values() for m in leaf.modules() if m is not leaf}
        leaf_ids = {id(m) for m in self.leaves.values()}
        self._owner: dict[int, str] = {}  # info order -> path of the module whose hooks gather it
        for path, module in model.named_modules():
            if id(module) in inside:
                continue
            infos = list({id(p): self.infos[id(p)] for p in module.parameters(recurse=id(module) in leaf_ids)
                          if id(p) in self.infos}.values())
            for info in infos:
                self._owner.setdefault(info.order, path)
            if all(info.persistent for info in infos):  # always gathered (norms, biases): nothing for hooks to do
                continue
            self._module_params[id(module)] = infos
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(module.register_forward_hook(self._post_forward))

    def _hook_gradients(self) -> None:
        for info in self.infos.values():
            if info.index is not None and info.numel:
                self._hooks.append(info.param.register_post_accumulate_grad_hook(
                    lambda p, info=info: self._on_grad(info)))

    def _init_reduction(self) -> None:
        """The gradient buckets and the bookkeeping of their reduction and of the step's uploads."""
        self._by_index = {i.index: i for i in self.infos.values() if i.index is not None}
        self._by_offset = [self._by_index[k] for k in sorted(self._by_index)]  # partition order
        self._uploaded: set[int] = set()  # layout indices whose shard was uploaded this step
        self.on_settle = None  # called with a bucket's master ranges once its gradient is on its way to them
        self._unwritten = set(self._by_index)
        self._buckets = self._grad_buckets()
        self.order = BucketOrder(self._buckets)
        self._grads: dict[int, torch.Tensor] = {}  # layout index -> full gradient waiting for its bucket
        # With peers, a bucket's reduction waits for the next point where every rank is (a gather's agreement,
        # or a backward fetch without the check): reducing as soon as a bucket is complete here would put the
        # reduce-scatter between other gathers on each rank, wherever its local gradients happened to arrive.
        self._sync_reductions = self.world > 1 and self.eager

    def _init_trace(self, model) -> None:
        """The module order trace for prefetching."""
        self._trace: list[int] = []
        self._trace_done = False
        self._cursor = 0
        self._ahead = 0
        self._outstanding: list[_Gather] = []
        self._modules: dict[int, torch.nn.Module] = {id(m): m for m in model.modules()}
        self._in_forward: dict[int, _Info] = {}  # parameters gathered for a forward that has not returned

    def _init_schedule(self, model) -> None:
        """With peers, the agreement on every gather (:class:`~.schedule.GatherSchedule`)."""
        ordered = sorted(self.infos.values(), key=lambda i: i.order)
        self.schedule = GatherSchedule(self.coll, self.device, model, owner=lambda order: self._owner.get(order, "?"),
                                       param_name=lambda order: ordered[order].name) if self.world > 1 else None
        if self.check_schedule:  # registered last: runs after the root's own hooks, when forward is over
            self._hooks.append(model.register_forward_hook(self._end_forward))

    # ------------------------------------------------------------------ gather
    def _shard(self, info: _Info) -> torch.Tensor:
        """A parameter's shard in the compute dtype: stored, or (``derive_shards``: the master partition is on
        the device) cast from the master where it is needed. Keeping a 16-bit copy of every trainable shard
        beside the master would hold 2 more bytes per parameter on the device between uses; the cast costs one
        pass over what a gather sends."""
        if info.shard is not None:
            return info.shard
        return self._master_piece(info).to(self.compute_dtype)

    def _master_piece(self, info: _Info) -> torch.Tensor:
        """A trainable parameter's shard of the master partition (a view)."""
        off = self.layout.part_offsets[info.index]
        return self.master[off:off + info.shard_size]

    def _launch_gather(self, infos: list[_Info], async_op: bool) -> _Gather | None:
        infos = [i for i in infos if i.inflight is None and i.param.numel() != i.numel]
        if not infos:
            return None
        if self._in_place:
            self._gather_in_place(infos)
            return None
        total = sum(i.shard_size for i in infos)
        if self.check_schedule:
            self._agree((infos[0].order, len(infos), total))
        event = None
        if self.offload_param:  # host shards: copied up beside the compute stream's kernels
            inp, event = self.transfer.upload_shards([self._shard(i) for i in infos], self.device)
        else:
            shards = [self._shard(i) for i in infos]
            inp = shards[0] if len(shards) == 1 else torch.cat(shards)
        if self.world == 1:  # the shard is the parameter: nothing to gather
            out, work = inp, None
        else:
            if event is not None:  # the collective reads it in this stream's order
                self.transfer.join(event)
                event = None
            out = torch.empty(total * self.world, dtype=self.compute_dtype, device=self.device)
            work = self.coll.all_gather(out, inp, async_op=async_op)
        g = _Gather(infos, out, work, inp, functools.partial(self.transfer.join, event) if event is not None else None)
        for i in infos:
            i.inflight = g
        return g

    def _gather_in_place(self, infos: list[_Info]) -> None:
        """World size 1 with the shards on the device: each parameter is its whole shard, cast."""
        dtype = self.compute_dtype
        for i in infos:
            i.param.data = i.whole.to(dtype)

    def _agree(self, row: tuple[int, int, int]) -> None:
        """Agree with every rank on the next gather (or end of forward or backward): see :mod:`.schedule`;
        then reduce the gradient buckets complete on every rank."""
        ready = self.order.ready() if self._sync_reductions else 0
        common = self.schedule.agree(row, ready)
        if self._sync_reductions:
            for k in self.order.take(common):
                self._reduce_bucket(k)

    def _reduce_complete_everywhere(self) -> None:
        """Without the schedule check: at a backward fetch (the same on every rank when the schedule is), reduce
        the buckets complete on every rank (one all-reduce of the ready count)."""
        ready = torch.tensor([-self.order.ready()], dtype=torch.int64)
        common = -int(self.coll.all_reduce(ready, op="max").item())
        for k in self.order.take(common):
            self._reduce_bucket(k)

    def _end_forward(self, module, args, output) -> None:
        self._agree((END_FORWARD, 0, 0))

    def _materialise(self, infos: list[_Info]) -> None:
        self._launch_gather(infos, async_op=False)
        for info in infos:
            if info.inflight is not None:
                info.inflight.finish(self.world)

    def _release(self, info: _Info) -> None:
        if info.persistent or info.active > 0 or info.inflight is not None or info.held:
            return
        if info.param.numel():
            info.param.data = self._empty

    def _fetch(self, module, backward: bool = False) -> list[_Info]:
        infos = self._module_params[id(module)]
        # in place each parameter is one cast: no communication, and no prefetch (nor its trace), which would have
        # nothing to overlap and would only hold parameters longer
        if self._in_place:
            self._gather_in_place([i for i in infos if i.param.numel() != i.numel])
        else:
            if backward and self._sync_reductions and not self.check_schedule:
                self._reduce_complete_everywhere()
            self._record(module)
            self._materialise(infos)
            self._prefetch()
        if backward:
            for info in infos:
                info.held = info.index is not None and info.numel > 0
        return infos

    def _record(self, module) -> None:
        key = id(module)
        if not self._trace_done:
            if len(self._trace) > 4 * len(self._modules):  # forwards without a backward (eval): start over
                self._trace.clear()
            self._trace.append(key)
            return
        if self._cursor < len(self._trace) and self._trace[self._cursor] == key:
            self._cursor += 1
        else:  # the order changed (dynamic control flow): stop prefetching until re-recorded
            self._cursor = len(self._trace) + 1

    def _prefetch(self) -> None:
        """Issue gathers for the next modules of the trace while at most ``stage3_prefetch_bucket_size``
        prefetched elements are outstanding. ``_ahead`` remembers how far prefetching got, so each
        trace entry is looked at about once per iteration."""
        if not self._trace_done or self.prefetch_budget <= 0 or self._cursor > len(self._trace):
            return
        self._outstanding = [g for g in self._outstanding if not g.done]
        inflight = sum(g.numel for g in self._outstanding)
        i = max(self._ahead, self._cursor)
        while i < len(self._trace):
            infos = [x for x in self._module_params[self._trace[i]]
                     if x.inflight is None and x.param.numel() != x.numel]
            need = sum(x.numel for x in infos)
            if inflight + need > self.prefetch_budget:
                break
            gather = self._launch_gather(infos, async_op=True) if infos else None
            if gather is not None:
                self._outstanding.append(gather)
                inflight += need
            i += 1
        self._ahead = i

    def _pre_forward(self, module, args):
        for info in self._fetch(module):
            info.active += 1
            if not info.persistent:
                self._in_forward[id(info)] = info

    def _post_forward(self, module, args, output):
        for info in self._module_params[id(module)]:
            info.active -= 1
            if info.active <= 0:
                self._in_forward.pop(id(info), None)
            self._release(info)
        if not torch.is_grad_enabled():
            return output
        return self._wrap_outputs(module, output)

    def pack_saved(self, t: torch.Tensor) -> _SavedParam | torch.Tensor:
        """The saved-tensor pack hook: a reference in place of ``t`` when ``t`` is (a view of) a parameter gathered
        for a running forward (see :class:`_SavedParam`); ``t`` itself otherwise."""
        if not self._in_forward or not t.numel() or t.layout is not torch.strided or t.is_nested:
            return t  # (a parameter is a plain strided tensor; sparse and nested ones have no single storage)
        ptr = t.untyped_storage().data_ptr()
        off = t.storage_offset()
        for info in self._in_forward.values():  # (parameters of one gather may share a storage: match the range)
            p = info.param
            if (p.numel() and p.dtype == t.dtype and p.untyped_storage().data_ptr() == ptr
                    and p.storage_offset() <= off < p.storage_offset() + p.numel()):
                return _SavedParam(info, t)
        return t

    def _wrap_outputs(self, module, output):
        if isinstance(output, torch.Tensor):  # (most modules: no structure to walk and rebuild)
            return _PreBackward.apply(self, module, output)[0] if output.requires_grad else output
        tensors = _tensors_needing_grad(output, [])
        if not tensors:
            return output
        wrapped = dict(zip(map(id, tensors), _PreBackward.apply(self, module, *tensors), strict=True))
        return _replace_tensors(output, wrapped)

    # --------------------------------------------------------------- gradients
    def _grad_buckets(self) -> list[list[int]]:
        """Fixed reduction buckets: trainable parameters in reverse registration order (roughly the order
        backward produces them), about ``reduce_bucket_size`` gathered elements each.

        At world size 1 every parameter is a bucket of its own unless the optimizer is offloaded: with
        nothing to exchange there is no collective to amortise, and waiting for a full bucket would hold a
        bucket's worth of gradients in backward, where the step's memory peaks. With the optimizer offloaded
        a bucket is also the unit of the copy down and of the overlapped host step, whose fixed costs (an
        event, a thread hand-off, an optimizer call, an upload) are paid per bucket."""
        limit = 1 if self.world == 1 and not self.offload_optimizer else self.bucket_size
        buckets, current, elems = [], [], 0
        for index in sorted(self._by_index, reverse=True):
            info = self._by_index[index]
            if not info.numel:
                continue
            current.append(index)
            elems += info.shard_size * self.world
            if elems >= limit:
                buckets.append(current)
                current, elems = [], 0
        if current:
            buckets.append(current)
        return buckets

    def _on_grad(self, info: _Info) -> None:
        if self.on_settle is not None and self.order.would_reopen(info.index):
            raise OverlapError(overlap_message(info.name))
        p = info.param
        g = p.grad.detach().reshape(-1)
        held = self._grads.get(info.index)
        self._grads[info.index] = g if held is None else held + g
        p.grad = None
        info.held = False
        self._release(info)
        if self._sync_reductions:
            self.order.record(info.index)
        elif self.eager:
            for k in self.order.arrive(info.index):
                self._reduce_bucket(k)

    def _reduce_bucket(self, k: int) -> None:
        entries = [self._by_index[i] for i in self._buckets[k]]
        if self.world == 1:  # nothing to exchange: the gradients themselves (one parameter: no packed copy)
            flat = [self._grads.pop(i.index, None) for i in entries]
            flat = [torch.zeros(i.numel, dtype=self.compute_dtype, device=self.device) if g is None
                    else g.to(self.compute_dtype) for g, i in zip(flat, entries, strict=True)]
            g = flat[0] if len(flat) == 1 else torch.cat(flat)
            self._settle(entries, g / self.divisor if self.divisor != 1 else g)
            return
        total = sum(i.shard_size for i in entries)
        inp = torch.zeros(self.world, total, dtype=self.compute_dtype, device=self.device)
        col = 0
        for info in entries:
            s = info.shard_size
            g = self._grads.pop(info.index, None)
            if g is not None:  # no gradient here this backward: zeros
                if s * self.world != info.numel:
                    g = F.pad(g, (0, s * self.world - info.numel))
                inp[:, col:col + s].copy_(g.view(self.world, s))
            col += s
        out = torch.empty(total, dtype=self.compute_dtype, device=self.device)
        self._reduce_scatter(entries, out, inp.view(-1))

    def _settle(self, entries: list[_Info], out: torch.Tensor) -> None:
        col, every_fresh, grad = 0, True, self.grad
        for info in entries:
            s = info.shard_size
            off = self.layout.part_offsets[info.index]
            fresh = info.index in self._unwritten  # the first gradient since zero_grad overwrites
            self._unwritten.discard(info.index)
            self.transfer.add_later(grad[off:off + s], out[col:col + s], grad, fresh, track=False)
            every_fresh = every_fresh and fresh
            col += s
        # the norm on the way down only for a partition on the host, which should never have to reduce it; one
        # on the device is reduced once at the step (one kernel, not four launches per bucket)
        if self.offload_optimizer:
            self.transfer.track(grad, out[:col], every_fresh)
        if self.on_settle is not None:
            ranges = []
            for info in sorted(entries, key=lambda i: self.layout.part_offsets[i.index]):
                lo = self.layout.part_offsets[info.index]
                if ranges and ranges[-1][1] == lo:
                    ranges[-1] = (ranges[-1][0], lo + info.shard_size)
                else:
                    ranges.append((lo, lo + info.shard_size))
            self.on_settle(ranges)

    def end_backward(self) -> None:
        if self.check_schedule:  # a rank with gathers left meets this and fails with the others, at once
            self._agree((END_BACKWARD, 0, 0))
        self.order.finish(self._reduce_bucket, lambda flags: self.coll.all_reduce(flags, op="max"))
        self._finish_reductions()
        for info in self.infos.values():  # frozen params, unused params and stale prefetches
            if info.inflight is not None:
                info.inflight.finish(self.world)
            # no forward runs now: a count left over is from a forward that never returned (non-reentrant
            # activation checkpointing stops its recomputation early by raising inside the module)
            info.active = 0
            info.held = False
            self._release(info)
        self._in_forward.clear()
        if self._trace and not self._trace_done:
            self._trace_done = True
        self._cursor = 0
        self._ahead = 0
        self._outstanding.clear()

    def reduce_at_boundary(self) -> None:
        """Gradients were reduced during backward."""

    def release_training_state(self) -> None:
        """Drop the master partition and the gradient partition (the engine is being destroyed). A shard read
        from the master gets its own copy first (a clone: the cast is a view when the dtypes agree), so the
        parameters survive in the compute dtype."""
        for info in self.infos.values():
            if info.shard is None:
                info.shard = self._shard(info).clone()
                if info.whole is not None:  # (a view of the master would keep it alive)
                    info.whole = info.shard[:info.numel].view(info.shape)
        self.master = None
        self._grad.release()

    def zero_grad(self) -> None:
        """Every bucket is reduced in each backward, so a parameter's first result overwrites its shard."""
        self._grad.release()
        self._unwritten = set(self._by_index)
        for info in self.infos.values():
            info.param.grad = None

    # ---------------------------------------------------------------- publish
    def upload_chunks(self) -> list[tuple[int, int]]:
        """Ranges of the master partition that :meth:`upload` takes: whole parameters' shards, about
        ``reduce_bucket_size / world`` elements each, in partition order."""
        bounds, size, target = [0], 0, max(1, self.bucket_size // self.world)
        for off, s in zip(self.layout.part_offsets, self.layout.shard_sizes, strict=True):
            size += s
            if size >= target:
                bounds.append(off + s)
                size = 0
        if bounds[-1] != self.layout.partition_size:
            bounds.append(self.layout.partition_size)
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    @torch.no_grad()
    def upload(self, lo: int, hi: int) -> None:
        """Start copying the updated master shards in ``[lo, hi)`` into the parameter shards."""
        offsets = self.layout.part_offsets
        infos = [i for i in self._by_offset if lo <= offsets[i.index] < hi and i.index not in self._uploaded]
        self.transfer.upload([(i.shard, self._master_piece(i)) for i in infos
                              if i.shard is not None])  # a derived shard is read from the master when gathered
        self._uploaded.update(i.index for i in infos)

    @torch.no_grad()
    def publish(self) -> None:
        """Copy the updated master shards into the parameter shards (what :meth:`upload` has not); re-gather
        persistent parameters."""
        if not self._uploaded:
            self.transfer.start_upload(self.layout.partition_size, self.compute_dtype)
        for lo, hi in self.upload_chunks():
            self.upload(lo, hi)
        self._uploaded.clear()
        for info in self.infos.values():
            if info.inflight is not None:  # a gather of pre-step values must not survive the step
                info.inflight.finish(self.world)
            info.active = 0
            info.held = False
            self._release(info)
        self._in_forward.clear()
        persistent = [i for i in self.infos.values() if i.persistent and i.index is not None and i.numel]
        if persistent:
            for i in persistent:
                i.param.data = self._empty
            self._materialise(persistent)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered (a collective), as clones by name; released again afterwards."""
        infos = list(self.infos.values())
        self._materialise(infos)
        out = {i.name: i.param.detach().clone() for i in infos}
        for i in infos:
            self._release(i)
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
        if not self.offload_param:
            n += sum(i.shard.numel() for i in self.infos.values() if i.shard is not None)
        return n
