"""Stage 3: parameters partitioned too, gathered around each submodule's forward and backward.

Each rank keeps only a shard of every parameter (on the device, or on the host with ``offload_param``); hooks
gather a module's parameters before it runs (prefetching the next ones), release them after, gather them again
for its backward, and reduce-scatter its gradients in rank-independent buckets. With peers and
``stage3_check_schedule`` every gather is agreed on first, so ranks whose modules ran differently raise
:class:`~.leaves.ScheduleMismatch` at once instead of hanging. :class:`ShardedParameters` hooks the model and
composes the parts: shards and gathers (:mod:`.stage3_gather`), gradient buckets (:mod:`.stage3_grads`), saved
tensors (:mod:`.stage3_saved`). The hooks, buckets and persistence in detail: docs/zero-stage3.md.
"""

from __future__ import annotations

import torch

from .leaves import find_leaf_modules
from .partition import GradientPartition, ShardLayout
from .partitioner import Partitioner, PartitionSetup
from .schedule import END_BACKWARD, END_FORWARD, GatherSchedule
from .split_partition import host_cut, split_allocator, warn_if_coarse
from .stage3_gather import ParamGatherer, ParamInfo, PrefetchTrace
from .stage3_grads import ShardGradients
from .stage3_saved import SavedParam, pack_saved, wrap_outputs


class ShardedParameters(Partitioner):
    """Stage 3 over one process group's parameters (``trainable`` and, for the first group, ``frozen``); every
    setting comes from ``setup.config`` (see :mod:`.config`), the runtime resources from ``setup``."""

    def __init__(self, model, trainable, frozen, *, coll, setup: PartitionSetup):
        super().__init__(coll, setup)
        cfg = setup.config
        self.check_schedule = cfg.stage3_check_schedule and self.world > 1
        names, shapes = [n for n, _ in trainable], [tuple(p.shape) for _, p in trainable]
        self.layout = ShardLayout(names, shapes, self.world)
        self.gatherer = ParamGatherer(trainable, frozen, coll=coll, setup=setup, transfer=self.transfer,
                                      master_piece=self._master_piece, agree=self._agree)
        self.infos: dict[int, ParamInfo] = self.gatherer.infos
        self.prefetch = PrefetchTrace(model, cfg.stage3_prefetch_bucket_size)
        # with the master partition on the device a shard is cast from it where needed (see
        # ParamGatherer.shard)
        derive = self.placement.shards.derive_from_master(self.placement.optimizer)
        self._partition_master(setup, derive_shards=derive)
        self.reducer = ShardGradients(self, setup, self.infos.values(), self._grad, self.gatherer.release)
        self._by_offset = [self.reducer.by_index[k] for k in sorted(self.reducer.by_index)]  # partition order
        self._uploaded: set[int] = set()  # layout indices whose shard was uploaded this step
        self._in_forward: dict[int, ParamInfo] = {}  # parameters gathered for a forward that has not returned
        self._hook_modules(model, cfg)
        self._hook_gradients()
        self._init_schedule(model)

    @property
    def on_settle(self):
        """Called with a bucket's master ranges once its gradient is on its way to them (the overlapped
        step)."""
        return self.reducer.on_settle

    @on_settle.setter
    def on_settle(self, fn) -> None:
        self.reducer.on_settle = fn

    def _partition_master(self, setup: PartitionSetup, derive_shards: bool) -> None:
        """The master partition, filled from the trainable shards (dropped when ``derive_shards``), and the
        gradient partition."""
        ratio, size = setup.placement.optimizer.ratio, self.layout.partition_size
        if ratio < 1:  # the parameters whose gradients land last (the first registered) stay on the device
            starts = sorted(self.layout.part_offsets)
            cut = host_cut(starts, size, ratio, host_first=False)
            warn_if_coarse(ratio, size - cut, size,
                           "parameters (a large one, such as the embedding, is one piece)")
            self.alloc_master = split_allocator(setup.alloc_master, self.device, size, cut, device_low=True)
        self.master = self.alloc_master(size, setup.master_dtype)
        for info in self.infos.values():
            if info.index is not None:
                off = self.layout.part_offsets[info.index]
                self.master[off:off + info.shard_size].copy_(info.shard)
                if derive_shards:
                    info.shard = None
        if self.gatherer.in_place:
            for info in self.infos.values():
                source = info.shard if info.shard is not None else self._master_piece(info)
                info.whole = source[:info.numel].view(info.shape)
        self._grad = GradientPartition(self.alloc_master, self.layout.partition_size,
                                       setup.grad_dtype or setup.master_dtype, self.device)

    def _hook_modules(self, model, cfg) -> None:
        """Gather and release hooks on every module (or leaf subtree) that owns a non-persistent parameter;
        note which module gathers each parameter."""
        self._module_params: dict[int, list[ParamInfo]] = {}
        self.leaves = find_leaf_modules(model, cfg.stage3_leaf_modules,
                                        cfg.stage3_module_granularity_threshold)
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
            # always gathered (norms, biases): nothing for hooks to do
            if all(info.persistent for info in infos):
                continue
            self._module_params[id(module)] = infos
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(module.register_forward_hook(self._post_forward))

    def _hook_gradients(self) -> None:
        for info in self.infos.values():
            if info.index is not None and info.numel:
                self._hooks.append(info.param.register_post_accumulate_grad_hook(
                    lambda p, info=info: self.reducer.on_grad(info)))

    def _init_schedule(self, model) -> None:
        """With peers, the agreement on every gather (:class:`~.schedule.GatherSchedule`)."""
        ordered = sorted(self.infos.values(), key=lambda i: i.order)
        self.schedule = None
        if self.world > 1:
            self.schedule = GatherSchedule(self.coll, self.device, model,
                                           owner=lambda order: self._owner.get(order, "?"),
                                           param_name=lambda order: ordered[order].name)
        if self.check_schedule:  # registered last: runs after the root's own hooks, when forward is over
            self._hooks.append(model.register_forward_hook(self._end_forward))

    # ------------------------------------------------------------------ gather
    def _master_piece(self, info: ParamInfo) -> torch.Tensor:
        """A trainable parameter's shard of the master partition (a view)."""
        off = self.layout.part_offsets[info.index]
        return self.master[off:off + info.shard_size]

    def _agree(self, row: tuple[int, int, int]) -> None:
        """Agree with every rank on the next gather (or end of forward or backward): see :mod:`.schedule`;
        then reduce the gradient buckets complete on every rank."""
        self.reducer.take(self.schedule.agree(row, self.reducer.ready()))

    def _end_forward(self, module, args, output) -> None:
        self._agree((END_FORWARD, 0, 0))

    def _fetch(self, module, backward: bool = False) -> list[ParamInfo]:
        infos = self._module_params[id(module)]
        gatherer = self.gatherer
        # in place each parameter is one cast: no communication, and no prefetch (nor its trace), which would
        # have nothing to overlap and would only hold parameters longer
        if gatherer.in_place:
            gatherer.gather_in_place([i for i in infos if i.param.numel() != i.numel])
        else:
            if backward and self.reducer.sync and not self.check_schedule:
                self.reducer.reduce_complete_everywhere()
            self.prefetch.record(module)
            gatherer.materialise(infos)
            self.prefetch.prefetch(self._module_params, gatherer.launch)
        if backward:
            for info in infos:
                info.held = info.index is not None and info.numel > 0
        return infos

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
            self.gatherer.release(info)
        if not torch.is_grad_enabled():
            return output
        return wrap_outputs(self, module, output)

    def pack_saved(self, t: torch.Tensor) -> SavedParam | torch.Tensor:
        """The saved-tensor pack hook: a reference in place of ``t`` when ``t`` is (a view of) a parameter
        gathered for a running forward (see :class:`~.stage3_saved.SavedParam`); ``t`` itself otherwise."""
        return pack_saved(self._in_forward, t)

    # --------------------------------------------------------------- gradients
    def end_backward(self) -> None:
        if self.check_schedule:  # a rank with gathers left meets this and fails with the others, at once
            self._agree((END_BACKWARD, 0, 0))
        self.reducer.finish()
        self.gatherer.release_all()  # frozen params, unused params and stale prefetches
        self._in_forward.clear()
        self.prefetch.end_iteration()

    def reduce_at_boundary(self) -> None:
        """Gradients were reduced during backward."""

    def release_training_state(self) -> None:
        """Drop the master partition and the gradient partition (the engine is being destroyed). A shard read
        from the master gets its own copy first (a clone: the cast is a view when the dtypes agree), so the
        parameters survive in the compute dtype."""
        for info in self.infos.values():
            if info.shard is None:
                info.shard = self.gatherer.shard(info).clone()
                if info.whole is not None:  # (a view of the master would keep it alive)
                    info.whole = info.shard[:info.numel].view(info.shape)
        self.master = None
        self._grad.release()

    def zero_grad(self) -> None:
        """Every bucket is reduced in each backward, so a parameter's first result overwrites its shard."""
        self.reducer.zero()
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
        # a derived shard (None) is read from the master when gathered
        self.transfer.upload([(i.shard, self._master_piece(i)) for i in infos if i.shard is not None])
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
        self.gatherer.release_all()  # a gather of pre-step values must not survive the step
        self._in_forward.clear()
        self.gatherer.regather_persistent()

    # ------------------------------------------------------------ checkpoints
    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered (a collective), as clones by name; released again afterwards."""
        return self.gatherer.full_params()

    def load_full(self, param, full: torch.Tensor) -> None:
        """Set a (frozen) parameter from its full value: keep this rank's shard of it."""
        self.gatherer.load_full(param, full)

    def device_param_elements(self) -> int:
        """Parameter elements resident on the device now: gathered tensors plus stored device shards."""
        return self.gatherer.device_param_elements()
