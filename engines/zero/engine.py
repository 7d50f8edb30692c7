"""The ZeRO training engine: wraps a model, owns its partitioned optimizer, steps and checkpoints."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, replace
from functools import partial

import torch
from polyaccel.errors import ConfigError
from polyaccel.parallel import get_layout, get_plan

from .activation_checkpoint import ActivationCheckpointer
from .collectives import Collectives, comm
from .config import _TOP_KEYS, ZeroConfig, parse_config
from .host_step import HostStepper
from .loss_scaler import LossScaler
from .offload import HostBuffers, HostTransfer
from .optimizer import PartitionOptimizer
from .partitioner import PartitionSetup
from .split_partition import SplitPartition, squared_norm
from .stage12 import FlatPartitioner
from .weight_decay import decay_runs, resolve_param_groups

DEFAULT_KEY = ("data", None, None)


def group_key(layout) -> tuple:
    """(replicas dimension, grad_sum dimension, split dimension): parameters that share it share a partition."""
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


def _pack_saved(packers, t: torch.Tensor):
    """Saved-tensor pack hook over several stage-3 groups: a parameter reference where one recognises ``t``."""
    for pack in packers:
        ref = pack(t)
        if ref is not t:
            return ref
    return t


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_comm() -> bool:
    """Initialise ``polyaccel.comm`` if needed; a process launched without a launcher is a world of one."""
    c = comm()
    if c.is_initialized():
        return False
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        c.init_distributed()
    else:
        c.init_distributed(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    return True


class ZeroEngine:
    """See :mod:`polyaccel.engines.zero` for the contract."""

    #: the top-level config keys the engine reads (``polyaccel.initialize`` adds the model layers' keys to these
    #: when it refuses an unknown one)
    CONFIG_KEYS = frozenset(_TOP_KEYS)

    def __init__(self, model: torch.nn.Module, config: dict | None = None, *, group=None, mesh=None,
                 param_groups=None):
        import polyaccel

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"polyaccel.initialize needs a torch.nn.Module, got {type(model).__name__}")
        self.accelerator = polyaccel.get_accelerator()
        self._owns_comm = _ensure_comm()
        self.device = self.accelerator.device()
        if mesh is not None and group is not None:
            raise ConfigError("pass either group= or mesh= to the ZeRO engine, not both")
        self.coll = Collectives(self.device, group)  # every rank the engine spans: global decisions, barriers
        self.rank, self.world_size = self.coll.rank, self.coll.world
        # the batch sizes count distinct batches: the sequence ranks of a group share one (mesh docs)
        data_ranks = mesh.size("batch") if mesh is not None else self.world_size
        self.config: ZeroConfig = parse_config(config, data_ranks)
        cfg = self.config
        self.stage = cfg.stage

        self._index_parameters(model)  # the groups are checked before the model is moved or cast
        #: ``{parameter name: weight decay}`` for the parameters ``param_groups`` gave a decay (the others take
        #: the config's ``optimizer.params.weight_decay``); see :mod:`.weight_decay`
        self.weight_decays = resolve_param_groups(
            param_groups, self.trainable + self.frozen, self.aliases, {n for n, _ in self.trainable},
            cfg.optimizer.weight_decay)
        self._place_model(model)
        self.host = self._host_buffers()
        alloc_master = self._master_allocator()
        #: ``engine.checkpoint(fn, *args)``: activation checkpointing as the config's ``activation_checkpointing``
        #: section says (installed into Hugging Face models when the section is present)
        self.checkpoint = ActivationCheckpointer(cfg.activation_checkpointing, self.accelerator, self.host)
        if cfg.activation_checkpointing.enabled:
            self.checkpoint.install(model)
        self.reduction_stream = self._reduction_stream()
        self.mesh = mesh
        self.transfer = HostTransfer(self.host, self.accelerator, self.device)
        self.stepper = HostStepper(self.transfer)
        self.scaler = LossScaler(cfg.fp16)
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.muon_choices = None  # optimizer.type "muon": {name: Choice}, made from the model's own shapes
        if cfg.optimizer.type == "muon":
            from .muon import choose_params

            self.muon_choices = choose_params(model, [n for n, _ in self.trainable], cfg.optimizer.muon)
        self.groups = self._build_groups(model, alloc_master, self.reduction_stream)
        packers = [g.partitioner.pack_saved for g in self.groups if hasattr(g.partitioner, "pack_saved")]
        self._saved_tensor_hooks = None  # stage 3: (pack, unpack), installed around every forward
        if packers:
            from .stage3 import unpack_saved

            # called for every tensor autograd saves in forward: one group's hook is installed as it is
            pack = packers[0] if len(packers) == 1 else partial(_pack_saved, packers)
            self._saved_tensor_hooks = (pack, unpack_saved)
        first = self.groups[0]
        self.partitioner, self.optimizer = first.partitioner, first.optimizer
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._grad_norm: float | torch.Tensor | None = None  # see last_grad_norm
        #: True when the last optimizer boundary was skipped (fp16 overflow: nothing applied, the scale lowered)
        self.last_step_skipped = False
        self._last_step_applied = False

    # ------------------------------------------------------------------ set-up
    def _place_model(self, model: torch.nn.Module) -> None:
        """Pick the compute and master dtypes, move the model to the device and cast it for mixed precision."""
        cfg = self.config
        self.compute_dtype = self._compute_dtype(model)
        self.master_dtype = torch.float64 if self.compute_dtype == torch.float64 else torch.float32
        if cfg.bf16 or cfg.fp16.enabled:  # cast where the model is, then move half the bytes
            model.to(self.compute_dtype)
        model.to(self.device)
        self.module = model

    def _index_parameters(self, model: torch.nn.Module) -> None:
        """Every parameter once, in registration order; aliases (tied weights) remembered by name."""
        seen: dict[int, str] = {}
        self.aliases: dict[str, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                self.aliases[name] = seen[id(p)]
            else:
                seen[id(p)] = name
        entries = list(model.named_parameters())
        self.trainable = [(n, p) for n, p in entries if p.requires_grad]
        self.frozen = [(n, p) for n, p in entries if not p.requires_grad]

    @property
    def offload_optimizer(self) -> bool:
        """Whether the master partitions and the optimizer step live on the host (``offload_optimizer``)."""
        return self.config.offload_optimizer.enabled

    def _host_buffers(self) -> HostBuffers:
        """Host memory for offloaded partitions, pinned where either offload section asks for it."""
        cfg = self.config
        return HostBuffers(self.accelerator, pin=cfg.offload_optimizer.pin_memory or cfg.offload_param.pin_memory)

    def _master_allocator(self):
        """``alloc_master(numel, dtype)`` for the fp32 master partitions: pinned host memory under optimizer
        offload, else the device."""
        host, offload = self.host, self.offload_optimizer
        master_device = torch.device("cpu") if offload else self.device

        def alloc_master(numel: int, dtype: torch.dtype) -> torch.Tensor:
            if offload:
                return host.empty(numel, dtype)
            return torch.empty(numel, dtype=dtype, device=master_device)

        return alloc_master

    def _reduction_stream(self):
        """A side stream for gradient reduction when overlap_comm is on and the device has streams, else None."""
        acc = self.accelerator
        if self.config.overlap_comm and acc.has("streams") and not acc.is_synchronized_device():
            return acc.Stream()
        return None

    def _build_groups(self, model, alloc_master, stream) -> list[ParamGroup]:
        """One partitioner and optimizer per kind of parameter layout (see :mod:`polyaccel.parallel`)."""
        by_key = self._entries_by_layout()
        keys = sorted(by_key, key=lambda k: (k != DEFAULT_KEY, tuple(x or "" for x in k))) or [DEFAULT_KEY]
        setup = PartitionSetup(
            config=self.config, device=self.device, compute_dtype=self.compute_dtype, master_dtype=self.master_dtype,
            alloc_master=alloc_master, host=self.host, accelerator=self.accelerator, reduction_stream=stream,
            transfer=self.transfer,
            eager=len(keys) == 1,  # several process groups: reduce after backward, group by group, in one order
            # the mean over every data-parallel rank's batch: an expert's gradient is summed over its expert_data
            # replicas but already holds the tokens of the whole expert group (they came through the all-to-all);
            # the sequence ranks of one group hold parts of one batch, so "batch" (not "data") counts the batches
            divisor=self.mesh.size("batch") if self.mesh is not None else None)
        return [self._param_group(model, key, by_key.get(key, []), self.frozen if key == keys[0] else [], setup)
                for key in keys]

    def _entries_by_layout(self) -> dict[tuple, list]:
        """The trainable parameters by :func:`group_key`; layouts the engine cannot serve are refused."""
        by_key: dict[tuple, list] = {}
        for name, p in self.trainable:
            by_key.setdefault(group_key(get_layout(p)), []).append((name, p))
        parallel = bool(by_key) and list(by_key) != [DEFAULT_KEY]
        if self.mesh is None and parallel:
            raise ConfigError("some parameters carry a tensor- or expert-parallel layout but the engine has no mesh; "
                              "let polyaccel.initialize apply the layers from the config, or pass mesh=")
        if self.config.offload_optimizer.ratio < 1 and any(key[1] for key in by_key):
            raise ConfigError("zero_optimization.offload_optimizer.ratio below 1 is not supported with parameters "
                              "replicated over tensor ranks (their partial gradients are summed over the whole "
                              "partition after backward); remove the ratio")
        if self.mesh is not None and self.config.optimizer.type == "lamb" and list(by_key) != [DEFAULT_KEY]:
            raise ConfigError("optimizer.type 'lamb' is not supported with tensor or expert parallelism: its trust "
                              "ratio needs the norm of each whole parameter, which is split over ranks here; "
                              "use adam, adamw or lion")
        return by_key

    def _param_group(self, model, key: tuple, entries: list, frozen: list, setup: PartitionSetup) -> ParamGroup:
        """The partitioner and optimizer of the parameters with layout ``key``."""
        cfg = self.config
        coll = self.coll if self.mesh is None else Collectives(self.device, self.mesh.group(key[0]))
        setup = replace(setup, grad_dtype=self._grad_dtype(key))
        if self.stage in (1, 2):
            part = FlatPartitioner(entries, coll=coll, setup=setup)
        else:
            from .stage3 import ShardedParameters

            part = ShardedParameters(model, entries, frozen, coll=coll, setup=setup)
        layout = part.layout
        if cfg.optimizer.type == "muon":
            opt = self._muon_optimizer(key, entries, part, coll, setup)
        else:
            runs = None
            if self.weight_decays:
                runs = decay_runs(layout.param_ranges(coll.rank), layout.names, self.weight_decays,
                                  cfg.optimizer.weight_decay)
            opt = PartitionOptimizer(
                cfg.optimizer, part.master, part.alloc_master,
                segment_ids=lambda layout=layout, rank=coll.rank: layout.segment_ids(rank),
                num_segments=len(layout.names), all_reduce=coll.all_reduce, decay_runs=runs)
        copies = 1
        if self.mesh is not None:
            split = self.mesh.size(key[2]) if key[2] else 1
            copies = self.world_size // (coll.world * split)
        grad_sum = Collectives(self.device, self.mesh.group(key[1])) if key[1] else None
        return ParamGroup(key, entries, coll, part, opt, copies, grad_sum)

    def _muon_optimizer(self, key: tuple, entries: list, part, coll, setup: PartitionSetup):
        """Muon for one group (see :mod:`.muon`), over the matrices :attr:`muon_choices` gives it."""
        from .muon import MuonPartitionOptimizer

        cfg = self.config
        tensor_coll = None
        if self.mesh is not None and key[2] == "tensor":
            tensor_coll = Collectives(self.device, self.mesh.group("tensor"))
        cap = cfg.optimizer.muon.gather_bucket_size or cfg.reduce_bucket_size
        return MuonPartitionOptimizer(cfg.optimizer, part.master, setup.alloc_master, layout=part.layout,
                                      coll=coll, choices=self.muon_choices, weight_decays=self.weight_decays,
                                      params=entries, comm_device=self.device, tensor_coll=tensor_coll,
                                      gather_cap=cap, accelerator=self.accelerator)

    def _grad_dtype(self, key: tuple) -> torch.dtype:
        """dtype of a group's gradient partition. Where nothing ever accumulates into it (one micro-step, no
        loss scaling, no sum over a replicated dimension), it only ever receives reduced buckets of the
        compute dtype: an fp32 copy of them would cost memory and add no precision, so it keeps the compute
        dtype (the optimizer reads 16-bit gradients; a clipping factor is applied in the master dtype at the
        step). On the host (optimizer offload) that saves 2 bytes a parameter of host memory (what bounds the
        largest model an offloaded GPU trains) and half the gradient's bytes over the bus; there a clipped
        step keeps the master dtype, since the sliced host step scales the partition in place. Otherwise the
        master dtype, which accumulates exactly."""
        if self.gradient_accumulation_steps != 1 or self.scaler.enabled or key[1]:
            return self.master_dtype
        if self.offload_optimizer and self.config.gradient_clipping > 0:
            return self.master_dtype
        return self.compute_dtype

    def _compute_dtype(self, model: torch.nn.Module) -> torch.dtype:
        cfg = self.config
        if cfg.bf16:
            self.accelerator.require("bf16", "set bf16.enabled to false")
            return torch.bfloat16
        if cfg.fp16.enabled:
            self.accelerator.require("fp16", "set fp16.enabled to false")
            return torch.float16
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if len(dtypes) > 1:
            raise ConfigError(
                f"the model's parameters mix dtypes {sorted(str(d) for d in dtypes)}; cast the model to one dtype "
                "or enable bf16/fp16 in the config"
            )
        return dtypes.pop() if dtypes else torch.float32

    # ------------------------------------------------------------- training API
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if self._saved_tensor_hooks is None:
            return self.module(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(*self._saved_tensor_hooks):
            return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale)."""
        scale = self.scaler.scale / self.gradient_accumulation_steps
        overlapped = self._step_overlaps_backward()
        if overlapped:
            g = self.groups[0]
            self.stepper.begin(g, self.compute_dtype)
            g.partitioner.on_settle = self.stepper.submit
        try:
            (loss * scale).backward(retain_graph=retain_graph)
            for g in self.groups:
                g.partitioner.end_backward()
        except BaseException:
            if overlapped:
                self.stepper.finish()
            raise
        finally:
            for g in self.groups:
                g.partitioner.on_settle = None
        return loss

    def _step_overlaps_backward(self) -> bool:
        """Whether the coming step can run bucket by bucket during backward (see :mod:`.host_step`): the
        optimizer is offloaded and element-wise, and nothing needs the whole gradient before stepping."""
        cfg = self.config
        if not (self.offload_optimizer and cfg.offload_optimizer.overlap_step):
            return False
        if self.gradient_accumulation_steps != 1 or cfg.gradient_clipping > 0 or self.scaler.enabled:
            return False
        if not self.stepper.available or self.stepper.active or len(self.groups) != 1:
            return False
        g = self.groups[0]
        sliced = g.optimizer.steps_in_slices or g.optimizer.defers_apply
        return g.grad_sum is None and sliced and g.partitioner.eager

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer boundary (before clipping; ``inf`` when fp16 overflowed
        and the step was skipped), or None before the first."""
        return self.last_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last :meth:`step` applied the optimizer (False between boundaries and on a skipped step)."""
        return self._last_step_applied

    def _move_to_boundary(self, boundary: bool) -> None:
        """Make the coming micro-step a boundary (``True``: a short window, e.g. an epoch's last) or not."""
        if boundary == self.is_gradient_accumulation_boundary():
            return
        gas = self.gradient_accumulation_steps
        if boundary:  # move the count to the window's last micro-step
            self.micro_steps += gas - 1 - self.micro_steps % gas
        elif gas == 1:
            raise ConfigError("step(boundary=False) with gradient_accumulation_steps 1: every micro-step is an "
                              "optimizer boundary, so the caller cannot defer one; configure the engine with the "
                              "caller's accumulation steps")
        else:
            self.micro_steps += 1

    @torch.no_grad()
    def step(self, boundary: bool | None = None) -> bool:
        """Count a micro-step; at an accumulation boundary apply the optimizer. True when it stepped.

        ``boundary`` (a trainer that decides where its accumulation windows end): True steps the optimizer now
        whatever the engine's own count says (a short last window), False only counts a micro-step; None: the
        count of ``gradient_accumulation_steps`` decides. A step skipped for an fp16 overflow returns False and
        sets ``last_step_skipped``.
        """
        self._last_step_applied = False
        if boundary is not None:
            self._move_to_boundary(bool(boundary))
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return False
        self.last_step_skipped = False
        for g in self.groups:
            g.partitioner.reduce_at_boundary()
            if g.grad_sum is not None:  # partial gradients of a replicated parameter: summed over that dimension
                g.partitioner.grad.copy_(g.grad_sum.all_reduce(g.partitioner.grad))
        self.global_steps += 1
        total = self._global_squared_norm()
        if self.scaler.enabled or self.config.gradient_clipping > 0:
            scale = self._host_scale(float(total.item()))
        else:  # nothing in this step depends on the norm: it stays on the device until asked for, so the host goes
            # on queueing the step's work instead of waiting for backward to finish (see last_grad_norm)
            self._grad_norm, scale = total, 1.0
        self._apply_all(scale)
        return self._last_step_applied

    def _host_scale(self, total: float) -> float | None:
        """The gradient scale of this step from the global squared norm read on the host (loss scaling,
        clipping); None when fp16 overflowed and the step is skipped (the scale lowered, gradients dropped)."""
        scale = 1.0
        if self.scaler.enabled:
            used = self.scaler.scale  # the scale this step's gradients carry
            overflow = not math.isfinite(total)
            self.scaler.update(overflow)
            if overflow:
                self.skipped_steps += 1
                self.last_step_skipped = True
                self._grad_norm = math.inf
                self.zero_grad()
                return None
            scale = 1.0 / used
        norm = math.sqrt(total) * scale
        self._grad_norm = norm
        if self.config.gradient_clipping > 0:
            scale *= min(1.0, self.config.gradient_clipping / (norm + 1e-6))
        return scale

    def _apply_all(self, scale: float | None) -> None:
        """The optimizer step of every group with the gradients scaled by ``scale`` (None: skipped)."""
        if scale is None:
            return
        if self.stepper.active:  # stepped and uploaded bucket by bucket during backward
            self.stepper.finish()
            self.groups[0].optimizer.finish_step()  # an optimizer whose slices were only prepared (Muon)
            self.groups[0].partitioner.publish()
        else:
            for g in self.groups:
                self._apply(g, scale)
        self.zero_grad()
        self._last_step_applied = True

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer boundary (see :meth:`get_global_grad_norm`). Kept on the
        device when the step did not need it; reading it then waits for that step's backward."""
        if isinstance(self._grad_norm, torch.Tensor):
            self._grad_norm = math.sqrt(float(self._grad_norm.item()))
        return self._grad_norm

    def _global_squared_norm(self) -> torch.Tensor:
        """The global squared gradient norm as a float64 tensor of one element, where the partitions are: the sum
        of the groups' (an element held by several ranks outside its partition group, a parameter replicated over
        tensor ranks, counts once), all-reduced. Not finite exactly when some rank's gradients overflowed, so one
        all-reduce serves the loss scaler too."""
        total = sum(self._squared_norm(g) / g.copies for g in self.groups)
        return self.coll.all_reduce(total.reshape(1).to(self.coll.device))

    def _squared_norm(self, g) -> torch.Tensor:
        """The squared norm of a group's gradient partition (a float64 scalar tensor): as the transfer saw it
        arrive, when it knows it exactly (an offloaded partition is then never reduced on the host), else from
        the partition."""
        part = g.partitioner
        if g.grad_sum is None:
            known = self.transfer.squared_norm(part.grad)
            if known is not None:
                return known
        return squared_norm(part.grad)

    def _apply(self, g, scale: float) -> None:
        """Optimizer step and write-back of one group. With the optimizer offloaded and an element-wise
        optimizer, slice by slice: each slice's upload runs while the host steps the next one."""
        part, opt, grad = g.partitioner, g.optimizer, g.partitioner.grad
        if not (self.offload_optimizer and opt.steps_in_slices):
            if scale != 1.0:  # a 16-bit gradient partition is scaled in a master-dtype copy: no extra rounding
                grad = grad.mul_(scale) if grad.dtype == part.master.dtype else grad.to(part.master.dtype).mul_(scale)
            opt.step(grad)
            part.publish()
            return
        opt.begin_step()
        self.transfer.start_upload(part.master.numel(), self.compute_dtype)
        chunks = part.upload_chunks()
        if isinstance(part.master, SplitPartition):  # the device's share first: it runs while the host steps
            chunks.sort(key=lambda c: not part.master.on_device(c[0]))
        for lo, hi in chunks:
            if scale != 1.0:
                grad[lo:hi].mul_(scale)
            opt.step_slice(grad, lo, hi)
            part.upload(lo, hi)
        part.publish()

    def zero_grad(self) -> None:
        self.transfer.reset_norms()
        for g in self.groups:
            g.partitioner.zero_grad()

    # --------------------------------------------------------------- inspection
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def optimizer_builder(self) -> str:
        return self.optimizer.builder_name

    @property
    def tp_plan(self):
        """The tensor-parallel plan a model layer applied (None without one)."""
        return get_plan(self.module, "tensor")

    @property
    def ep_plan(self):
        """The expert-parallel plan a model layer applied (None without one)."""
        return get_plan(self.module, "expert")

    def get_lr(self) -> float:
        return self.optimizer.lr

    def set_lr(self, lr: float) -> None:
        for g in self.groups:
            g.optimizer.lr = float(lr)

    @property
    def host_optimizer_share(self) -> float:
        """The share of this rank's master elements whose optimizer step runs on the host: 0 without
        ``offload_optimizer``, 1 with it, in between with ``offload_optimizer.ratio`` below 1 (the ratio rounded
        to whole buckets, or whole parameters in stage 3)."""
        if not self.offload_optimizer:
            return 0.0
        total = sum(g.partitioner.master.numel() for g in self.groups)
        host = sum(getattr(g.partitioner.master, "host_elements", g.partitioner.master.numel()) for g in self.groups)
        return host / total if total else 1.0

    def optimizer_state_elements(self) -> int:
        """Elements of optimizer state (master copy + moments) this rank holds."""
        return sum(g.partitioner.master.numel() + g.optimizer.state_elements() for g in self.groups)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter (gathered over its partition group, compute dtype) by name: a collective in stage 3.
        A parameter split over tensor or expert ranks appears as this rank's piece."""
        full = {}
        for g in self.groups:
            full.update(g.partitioner.full_params())
        for name, p in self.frozen:
            if name not in full:
                full[name] = p.detach().clone()
        return full

    # -------------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None) -> str:
        from .checkpoint import save

        return save(self, save_dir, tag=tag, client_state=client_state)

    def load_checkpoint(self, load_dir, tag=None):
        from .checkpoint import load

        return load(self, load_dir, tag=tag)

    def destroy(self) -> None:
        """Remove hooks; drop the master copies, optimizer state and gradients (device memory comes back now,
        not when the garbage collector finds the engine; the module keeps its parameters); release registered
        host memory; tear down comm if the engine set it up. The engine cannot step afterwards."""
        self.stepper.close()
        for g in self.groups:
            g.partitioner.remove_hooks()
            g.partitioner.release_training_state()
            g.optimizer.release()
        self.host.release()
        if self._owns_comm:
            comm().destroy()
            self._owns_comm = False
