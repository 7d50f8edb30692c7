"""The ZeRO training engine: wraps a model, owns its partitioned optimizer, steps and checkpoints."""

from __future__ import annotations

import math
import os
import socket

import torch
from polyaccel.errors import ConfigError

from .activation_checkpoint import ActivationCheckpointer
from .collectives import Collectives, comm
from .config import _TOP_KEYS, ZeroConfig, parse_config
from .engine_state import EngineState
from .groups import GroupBuilder, compute_dtype, global_squared_norm, index_parameters
from .host_step import HostStepper
from .loss_scaler import LossScaler
from .offload import HostBuffers, HostTransfer
from .partitioner import PartitionSetup
from .placement import choose_placement
from .stage3_saved import saved_tensor_hooks
from .weight_decay import resolve_param_groups


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


class ZeroEngine(EngineState):
    """See :mod:`polyaccel.engines.zero` for the contract."""

    #: the top-level config keys the engine reads (``polyaccel.initialize`` adds the model layers' keys to
    #: these when it refuses an unknown one)
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

        # the groups are checked before the model is moved or cast; aliases: tied weights by name
        self.aliases, self.trainable, self.frozen = index_parameters(model)
        #: ``{parameter name: weight decay}`` for the parameters ``param_groups`` gave a decay (the others
        #: take the config's ``optimizer.params.weight_decay``); see :mod:`.weight_decay`
        self.weight_decays = resolve_param_groups(
            param_groups, self.trainable + self.frozen, self.aliases, {n for n, _ in self.trainable},
            cfg.optimizer.weight_decay)
        self._place_model(model)
        self.host = self._host_buffers()
        #: where the optimizer and the stage-3 shards live (``offload_optimizer``, ``offload_param``)
        self.placement = choose_placement(cfg, self.device, self.host)
        #: ``engine.checkpoint(fn, *args)``: activation checkpointing as the config's
        #: ``activation_checkpointing`` section says (installed into Hugging Face models when the section is
        #: present)
        self.checkpoint = ActivationCheckpointer(cfg.activation_checkpointing, self.accelerator, self.host)
        if cfg.activation_checkpointing.enabled:
            self.checkpoint.install(model)
        self.reduction_stream = self._reduction_stream()
        self.mesh = mesh
        self.transfer = HostTransfer(self.host, self.accelerator, self.device)
        self.stepper = HostStepper(self.transfer, cfg.offload_optimizer.host_threads)
        self.scaler = LossScaler(cfg.fp16)
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.muon_choices = None  # optimizer.type "muon": {name: Choice}, made from the model's own shapes
        if cfg.optimizer.type == "muon":
            from .muon import choose_params

            self.muon_choices = choose_params(model, [n for n, _ in self.trainable], cfg.optimizer.muon)
        self.groups = GroupBuilder(self).build(model, self.reduction_stream)
        # stage 3: (pack, unpack), installed around every forward
        self._saved_tensor_hooks = saved_tensor_hooks([g.partitioner for g in self.groups])
        first = self.groups[0]
        self.partitioner, self.optimizer = first.partitioner, first.optimizer
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._grad_norm: float | torch.Tensor | None = None  # see last_grad_norm
        #: True when the last optimizer boundary was skipped (fp16 overflow: nothing applied, the scale
        #: lowered)
        self.last_step_skipped = False
        self._last_step_applied = False

    # ------------------------------------------------------------------ set-up
    def _place_model(self, model: torch.nn.Module) -> None:
        """Pick the compute and master dtypes, move the model to the device and cast it for mixed
        precision."""
        cfg = self.config
        self.compute_dtype = compute_dtype(model, cfg, self.accelerator)
        self.master_dtype = torch.float64 if self.compute_dtype == torch.float64 else torch.float32
        if cfg.bf16 or cfg.fp16.enabled:  # cast where the model is, then move half the bytes
            model.to(self.compute_dtype)
        model.to(self.device)
        self.module = model

    def _host_buffers(self) -> HostBuffers:
        """Host memory for offloaded partitions, pinned where either offload section asks for it."""
        cfg = self.config
        pin = cfg.offload_optimizer.pin_memory or cfg.offload_param.pin_memory
        return HostBuffers(self.accelerator, pin=pin)

    def _reduction_stream(self):
        """A side stream for gradient reduction when overlap_comm is on and the device has streams, else
        None."""
        acc = self.accelerator
        if self.config.overlap_comm and acc.has("streams") and not acc.is_synchronized_device():
            return acc.Stream()
        return None

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
        if not self.placement.optimizer.overlap_step:
            return False
        if self.gradient_accumulation_steps != 1 or cfg.gradient_clipping > 0 or self.scaler.enabled:
            return False
        if not self.stepper.available or self.stepper.active or len(self.groups) != 1:
            return False
        g = self.groups[0]
        sliced = g.optimizer.steps_in_slices or g.optimizer.defers_apply
        return g.grad_sum is None and sliced and g.partitioner.eager

    def _move_to_boundary(self, boundary: bool) -> None:
        """Make the coming micro-step a boundary (``True``: a short window, e.g. an epoch's last) or not."""
        if boundary == self.is_gradient_accumulation_boundary():
            return
        gas = self.gradient_accumulation_steps
        if boundary:  # move the count to the window's last micro-step
            self.micro_steps += gas - 1 - self.micro_steps % gas
        elif gas == 1:
            raise ConfigError("step(boundary=False) with gradient_accumulation_steps 1: every micro-step is "
                              "an optimizer boundary, so the caller cannot defer one; configure the engine "
                              "with the caller's accumulation steps")
        else:
            self.micro_steps += 1

    @torch.no_grad()
    def step(self, boundary: bool | None = None) -> bool:
        """Count a micro-step; at an accumulation boundary apply the optimizer. True when it stepped.

        ``boundary`` (a trainer that decides where its accumulation windows end): True steps the optimizer now
        whatever the engine's own count says (a short last window), False only counts a micro-step; None: the
        count of ``gradient_accumulation_steps`` decides. A step skipped for an fp16 overflow returns False
        and sets ``last_step_skipped``.
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
            # partial gradients of a replicated parameter: summed over that dimension
            if g.grad_sum is not None:
                g.partitioner.grad.copy_(g.grad_sum.all_reduce(g.partitioner.grad))
        self.global_steps += 1
        total = global_squared_norm(self.groups, self.coll, self.transfer)
        if self.scaler.enabled or self.config.gradient_clipping > 0:
            scale = self._host_scale(float(total.item()))
        else:  # nothing in this step depends on the norm: it stays on the device until asked for, so the host
            # goes on queueing the step's work instead of waiting for backward to finish (see last_grad_norm)
            self._grad_norm, scale = total, 1.0
        self._apply_all(scale)
        return self._last_step_applied

    def _host_scale(self, total: float) -> float | None:
        """The gradient scale of this step from the global squared norm read on the host (loss scaling,
        clipping); None when fp16 overflowed and the step is skipped (the scale lowered, gradients
        dropped)."""
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
            try:
                self.stepper.wait()
                # slices only prepared (Muon): applied now, their uploads deferred like the overlapped ones
                self.groups[0].optimizer.finish_step(self.groups[0].partitioner)
            finally:
                self.stepper.finish()
            self.groups[0].partitioner.publish()
        else:
            for g in self.groups:
                self._apply(g, scale)
        self.zero_grad()
        self._last_step_applied = True

    def _apply(self, g, scale: float) -> None:
        """Optimizer step and write-back of one group, where the placement runs it (see :mod:`.placement`)."""
        self.placement.optimizer.apply(g.partitioner, g.optimizer, scale, self.transfer, self.compute_dtype)

    def zero_grad(self) -> None:
        self.transfer.reset_norms()
        for g in self.groups:
            g.partitioner.zero_grad()

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
