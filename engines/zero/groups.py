"""The engine's partition groups: one partitioner and optimizer per kind of parameter layout.

Parameters that share (replicas dimension, grad_sum dimension, split dimension) of their
:mod:`polyaccel.parallel` layout share a process group and so a partition; without a mesh there
is one group. :class:`GroupBuilder` makes them once, at engine set-up, from the engine's settled
attributes (config, placement, dtypes, mesh, the trainable and frozen parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from polyaccel.errors import ConfigError
from polyaccel.parallel import get_layout

from .collectives import Collectives
from .optimizer import PartitionOptimizer
from .partitioner import PartitionSetup
from .split_partition import squared_norm
from .stage12 import FlatPartitioner
from .weight_decay import decay_runs

DEFAULT_KEY = ("data", None, None)


def group_key(layout) -> tuple:
    """(replicas dimension, grad_sum dimension, split dimension): parameters that share it share a
    partition."""
    return (layout.replicas, layout.grad_sum, layout.split.dim if layout.split is not None else None)


@dataclass
class ParamGroup:
    """Parameters with one kind of layout: their partition group, partitioner and optimizer.

    ``copies``: how many ranks outside the partition group hold the same elements (tensor ranks holding
    a replicated parameter), so the gradient norm counts each element once.
    """

    key: tuple
    entries: list
    coll: Collectives
    partitioner: object
    optimizer: PartitionOptimizer
    copies: int
    grad_sum: Collectives | None


def index_parameters(model: torch.nn.Module) -> tuple[dict[str, str], list, list]:
    """``(aliases, trainable, frozen)``: every parameter once, in registration order, trainable or frozen;
    aliases (tied weights) as ``{alias: name}``."""
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    entries = list(model.named_parameters())
    trainable = [(n, p) for n, p in entries if p.requires_grad]
    return aliases, trainable, [(n, p) for n, p in entries if not p.requires_grad]


def compute_dtype(model: torch.nn.Module, cfg, accelerator) -> torch.dtype:
    """The dtype the model computes in: bf16 or fp16 as the config asks, else the model's own."""
    if cfg.bf16:
        accelerator.require("bf16", "set bf16.enabled to false")
        return torch.bfloat16
    if cfg.fp16.enabled:
        accelerator.require("fp16", "set fp16.enabled to false")
        return torch.float16
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) > 1:
        raise ConfigError(
            f"the model's parameters mix dtypes {sorted(str(d) for d in dtypes)}; cast the model to one "
            "dtype or enable bf16/fp16 in the config"
        )
    return dtypes.pop() if dtypes else torch.float32


def global_squared_norm(groups: list[ParamGroup], coll, transfer) -> torch.Tensor:
    """The global squared gradient norm as a float64 tensor of one element, where the partitions are: the sum
    of the groups' (an element held by several ranks outside its partition group, a parameter replicated over
    tensor ranks, counts once), all-reduced. Not finite exactly when some rank's gradients overflowed, so one
    all-reduce serves the loss scaler too."""
    total = sum(_squared_norm(g, transfer) / g.copies for g in groups)
    return coll.all_reduce(total.reshape(1).to(coll.device))


def _squared_norm(g: ParamGroup, transfer) -> torch.Tensor:
    """The squared norm of a group's gradient partition (a float64 scalar tensor): as the transfer saw it
    arrive, when it knows it exactly (an offloaded partition is then never reduced on the host), else from
    the partition."""
    part = g.partitioner
    if g.grad_sum is None:
        known = transfer.squared_norm(part.grad)
        if known is not None:
            return known
    return squared_norm(part.grad)


class GroupBuilder:
    """Makes the :class:`ParamGroup` list of ``engine`` (a :class:`~.engine.ZeroEngine` being set up); a Muon
    group's optimizer comes from the engine's ``_muon_optimizer``."""

    def __init__(self, engine):
        self.engine = engine
        self.config = engine.config

    def build(self, model, stream) -> list[ParamGroup]:
        """One partitioner and optimizer per kind of parameter layout (see :mod:`polyaccel.parallel`)."""
        e = self.engine
        by_key = self.entries_by_layout()
        keys = sorted(by_key, key=lambda k: (k != DEFAULT_KEY, tuple(x or "" for x in k))) or [DEFAULT_KEY]
        setup = PartitionSetup(
            config=self.config, placement=e.placement, device=e.device, compute_dtype=e.compute_dtype,
            master_dtype=e.master_dtype, alloc_master=e.placement.optimizer.alloc_master, host=e.host,
            accelerator=e.accelerator, reduction_stream=stream, transfer=e.transfer,
            # several process groups: reduce after backward, group by group, in one order
            eager=len(keys) == 1,
            # the mean over every data-parallel rank's batch: an expert's gradient is summed over its
            # expert_data replicas but already holds the tokens of the whole expert group (they came through
            # the all-to-all); the sequence ranks of one group hold parts of one batch, so "batch" (not
            # "data") counts the batches
            divisor=e.mesh.size("batch") if e.mesh is not None else None)
        return [self.param_group(model, key, by_key.get(key, []), e.frozen if key == keys[0] else [], setup)
                for key in keys]

    def entries_by_layout(self) -> dict[tuple, list]:
        """The trainable parameters by :func:`group_key`; layouts the engine cannot serve are refused."""
        by_key: dict[tuple, list] = {}
        for name, p in self.engine.trainable:
            by_key.setdefault(group_key(get_layout(p)), []).append((name, p))
        parallel = bool(by_key) and list(by_key) != [DEFAULT_KEY]
        mesh = self.engine.mesh
        if mesh is None and parallel:
            raise ConfigError("some parameters carry a tensor- or expert-parallel layout but the engine has "
                              "no mesh; let polyaccel.initialize apply the layers from the config, or pass "
                              "mesh=")
        if self.engine.placement.optimizer.ratio < 1 and any(key[1] for key in by_key):
            raise ConfigError("zero_optimization.offload_optimizer.ratio below 1 is not supported with "
                              "parameters replicated over tensor ranks (their partial gradients are summed "
                              "over the whole partition after backward); remove the ratio")
        if mesh is not None and self.config.optimizer.type == "lamb" and list(by_key) != [DEFAULT_KEY]:
            raise ConfigError("optimizer.type 'lamb' is not supported with tensor or expert parallelism: "
                              "its trust ratio needs the norm of each whole parameter, which is split over "
                              "ranks here; use adam, adamw or lion")
        return by_key

    def param_group(self, model, key: tuple, entries: list, frozen: list,
                    setup: PartitionSetup) -> ParamGroup:
        """The partitioner and optimizer of the parameters with layout ``key``."""
        e, cfg = self.engine, self.config
        coll = e.coll if e.mesh is None else Collectives(e.device, e.mesh.group(key[0]))
        setup = replace(setup, grad_dtype=self.grad_dtype(key))
        if e.stage in (1, 2):
            part = FlatPartitioner(entries, coll=coll, setup=setup)
        else:
            from .stage3 import ShardedParameters

            part = ShardedParameters(model, entries, frozen, coll=coll, setup=setup)
        layout = part.layout
        if cfg.optimizer.type == "muon":
            opt = e._muon_optimizer(key, entries, part, coll, setup)
        else:
            runs = None
            if e.weight_decays:
                runs = decay_runs(layout.param_ranges(coll.rank), layout.names, e.weight_decays,
                                  cfg.optimizer.weight_decay)
            opt = PartitionOptimizer(
                cfg.optimizer, part.master, part.alloc_master,
                segment_ids=lambda layout=layout, rank=coll.rank: layout.segment_ids(rank),
                num_segments=len(layout.names), all_reduce=coll.all_reduce, decay_runs=runs)
        copies = 1
        if e.mesh is not None:
            split = e.mesh.size(key[2]) if key[2] else 1
            copies = e.world_size // (coll.world * split)
        grad_sum = Collectives(e.device, e.mesh.group(key[1])) if key[1] else None
        return ParamGroup(key, entries, coll, part, opt, copies, grad_sum)

    def grad_dtype(self, key: tuple) -> torch.dtype:
        """dtype of a group's gradient partition. Where nothing ever accumulates into it (one micro-step, no
        loss scaling, no sum over a replicated dimension), it only ever receives reduced buckets of the
        compute dtype: an fp32 copy of them would cost memory and add no precision, so it keeps the compute
        dtype (the optimizer reads 16-bit gradients; a clipping factor is applied in the master dtype at the
        step). On the host (optimizer offload) that saves 2 bytes a parameter of host memory (what bounds the
        largest model an offloaded GPU trains) and half the gradient's bytes over the bus; there a clipped
        step keeps the master dtype, since the sliced host step scales the partition in place. Otherwise the
        master dtype, which accumulates exactly."""
        e = self.engine
        if e.gradient_accumulation_steps != 1 or e.scaler.enabled or key[1]:
            return e.master_dtype
        if e.placement.optimizer.grad_needs_master_dtype(self.config.gradient_clipping):
            return e.master_dtype
        return e.compute_dtype
