"""The ZeRO training engine: wraps a model, owns its partitioned optimizer, steps and checkpoints."""

from __future__ import annotations

import math
import os
import socket

import torch
from polyaccel.errors import ConfigError

from .collectives import Collectives, comm
from .config import ZeroConfig, parse_config
from .loss_scaler import LossScaler
from .offload import HostBuffers
from .optimizer import PartitionOptimizer
from .stage12 import FlatPartitioner


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

    def __init__(self, model: torch.nn.Module, config: dict | None = None, *, group=None):
        import polyaccel

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"polyaccel.initialize needs a torch.nn.Module, got {type(model).__name__}")
        self.accelerator = polyaccel.get_accelerator()
        self._owns_comm = _ensure_comm()
        self.device = self.accelerator.device()
        self.coll = Collectives(self.device, group)
        self.rank, self.world_size = self.coll.rank, self.coll.world
        self.config: ZeroConfig = parse_config(config, self.world_size)
        cfg = self.config
        self.stage = cfg.stage

        self.compute_dtype = self._compute_dtype(model)
        self.master_dtype = torch.float64 if self.compute_dtype == torch.float64 else torch.float32
        model.to(self.device)
        if cfg.bf16 or cfg.fp16.enabled:
            model.to(self.compute_dtype)
        self.module = model

        # every parameter once, in registration order; aliases (tied weights) remembered by name
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

        self.offload_optimizer = cfg.offload_optimizer.enabled
        self.host = HostBuffers(self.accelerator, pin=cfg.offload_optimizer.pin_memory or cfg.offload_param.pin_memory)
        master_device = torch.device("cpu") if self.offload_optimizer else self.device

        def alloc_master(numel: int, dtype: torch.dtype) -> torch.Tensor:
            if self.offload_optimizer:
                return self.host.empty(numel, dtype)
            return torch.empty(numel, dtype=dtype, device=master_device)

        stream = None
        if cfg.overlap_comm and self.accelerator.has("streams") and not self.accelerator.is_synchronized_device():
            stream = self.accelerator.Stream()
        self.reduction_stream = stream
        if self.stage in (1, 2):
            self.partitioner = FlatPartitioner(
                self.trainable, stage=self.stage, coll=self.coll, device=self.device,
                compute_dtype=self.compute_dtype, master_dtype=self.master_dtype,
                bucket_size=cfg.reduce_bucket_size, overlap_comm=cfg.overlap_comm, alloc_master=alloc_master,
                reduction_stream=stream, accelerator=self.accelerator)
        else:
            from .stage3 import ShardedParameters

            self.partitioner = ShardedParameters(
                model, self.trainable, self.frozen, coll=self.coll, device=self.device,
                compute_dtype=self.compute_dtype, master_dtype=self.master_dtype, config=cfg,
                alloc_master=alloc_master, host=self.host, reduction_stream=stream, accelerator=self.accelerator)
        layout = self.partitioner.layout
        self.optimizer = PartitionOptimizer(
            cfg.optimizer, self.partitioner.master, alloc_master, segment_ids=layout.segment_ids(self.rank),
            num_segments=len(layout.names), all_reduce=self.coll.all_reduce)
        self.scaler = LossScaler(cfg.fp16)
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None

    # ------------------------------------------------------------------ set-up
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
        (loss * scale).backward(retain_graph=retain_graph)
        self.partitioner.end_backward()
        return loss

    @torch.no_grad()
    def step(self) -> bool:
        """Count a micro-step; at an accumulation boundary apply the optimizer. True when it stepped."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return False
        self.partitioner.reduce_at_boundary()
        grad = self.partitioner.grad
        self.global_steps += 1
        if self.scaler.enabled:
            used = self.scaler.scale  # the scale this step's gradients carry
            bad = torch.tensor([0.0 if bool(torch.isfinite(grad).all()) else 1.0], dtype=torch.float32)
            overflow = bool(self.coll.all_reduce(bad, op="max").item() > 0)
            self.scaler.update(overflow)
            if overflow:
                self.skipped_steps += 1
                self.last_grad_norm = math.inf
                self.zero_grad()
                return False
            scale = 1.0 / used
        else:
            scale = 1.0
        # the global norm (reported, and used for clipping) from the partitions' squared norms
        sq = grad.double().square().sum().reshape(1)
        norm = math.sqrt(float(self.coll.all_reduce(sq).item())) * scale
        self.last_grad_norm = norm
        if self.config.gradient_clipping > 0:
            scale *= min(1.0, self.config.gradient_clipping / (norm + 1e-6))
        if scale != 1.0:
            grad.mul_(scale)
        self.optimizer.step(grad)
        self.partitioner.publish()
        self.zero_grad()
        return True

    def zero_grad(self) -> None:
        self.partitioner.zero_grad()

    # --------------------------------------------------------------- inspection
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def optimizer_builder(self) -> str:
        return self.optimizer.builder_name

    def get_lr(self) -> float:
        return self.optimizer.lr

    def set_lr(self, lr: float) -> None:
        self.optimizer.lr = float(lr)

    def optimizer_state_elements(self) -> int:
        """Elements of optimizer state (master copy + moments) this rank holds."""
        return self.partitioner.master.numel() + self.optimizer.state_elements()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter (gathered, compute dtype) by name: a collective in stage 3."""
        full = self.partitioner.full_params()
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
        """Remove hooks, release registered host memory, and tear down comm if the engine set it up."""
        self.partitioner.remove_hooks()
        self.host.release()
        if self._owns_comm:
            comm().destroy()
            self._owns_comm = False
