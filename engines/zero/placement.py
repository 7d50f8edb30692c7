"""Where the optimizer and the stage-3 parameter shards live: chosen once from the config, like the stage.

The engine makes one :class:`Placement` and hands it to every partitioner. Each half is an object
with the few operations that differ between keeping a thing on the device and keeping it in host
memory (``offload_optimizer``, ``offload_param``); nothing else asks whether something is offloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .split_partition import SplitPartition


def step_whole(part, opt, scale: float) -> None:
    """Optimizer step of a whole partition, then the write-back of the parameters."""
    grad = part.grad
    if scale != 1.0:  # a 16-bit gradient partition is scaled in a master-dtype copy: no extra rounding
        grad = grad.mul_(scale) if grad.dtype == part.master.dtype else grad.to(part.master.dtype).mul_(scale)
    opt.step(grad)
    part.publish()


def step_in_slices(part, opt, scale: float, transfer, compute_dtype: torch.dtype) -> None:
    """Optimizer step slice by slice: each slice's upload runs while the host steps the next one."""
    grad = part.grad
    opt.begin_step()
    transfer.start_upload(part.master.numel(), compute_dtype)
    chunks = part.upload_chunks()
    if isinstance(part.master, SplitPartition):  # the device's share first: it runs while the host steps
        chunks.sort(key=lambda c: not part.master.on_device(c[0]))
    for lo, hi in chunks:
        if scale != 1.0:
            grad[lo:hi].mul_(scale)
        opt.step_slice(grad, lo, hi)
        part.upload(lo, hi)
    part.publish()


class OptimizerOnDevice:
    """Master partitions, optimizer state and step on the device."""

    on_host = False
    #: the overlapped host step (see :mod:`.host_step`) has nothing to overlap
    overlap_step = False
    #: the share of each master partition kept in host memory (see :mod:`.split_partition`)
    ratio = 1.0

    def __init__(self, device: torch.device):
        self.device = device

    def alloc_master(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def grad_needs_master_dtype(self, clipping: float) -> bool:
        """Whether a clipped step needs the gradient partition in the master dtype (see
        :meth:`.groups.GroupBuilder.grad_dtype`): on the device the clipping factor is applied to a copy."""
        return False

    def apply(self, part, opt, scale: float, transfer, compute_dtype: torch.dtype) -> None:
        step_whole(part, opt, scale)

    def host_share(self, masters: list) -> float:
        """The share of the master elements stepped on the host."""
        return 0.0


class OptimizerOnHost:
    """``offload_optimizer``: master partitions (all or, with ``ratio`` below 1, a share), optimizer state and
    step in host memory from ``host`` (a :class:`~.offload.HostBuffers`)."""

    on_host = True

    def __init__(self, device: torch.device, host, overlap_step: bool, ratio: float):
        self.device = device
        self.host = host
        self.overlap_step = overlap_step
        self.ratio = ratio

    def alloc_master(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.host.empty(numel, dtype)

    def grad_needs_master_dtype(self, clipping: float) -> bool:
        # the sliced host step scales the partition in place
        return clipping > 0

    def apply(self, part, opt, scale: float, transfer, compute_dtype: torch.dtype) -> None:
        if opt.steps_in_slices:
            step_in_slices(part, opt, scale, transfer, compute_dtype)
        else:
            step_whole(part, opt, scale)

    def host_share(self, masters: list) -> float:
        total = sum(m.numel() for m in masters)
        host = sum(getattr(m, "host_elements", m.numel()) for m in masters)
        return host / total if total else 1.0


class ShardsOnDevice:
    """Stage-3 parameter shards on the device."""

    on_host = False

    def __init__(self, device: torch.device):
        self.device = device

    def homes(self, sizes: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        """Storage for shards of ``sizes`` elements."""
        return [torch.empty(s, dtype=dtype, device=self.device) for s in sizes]

    def in_place(self, world: int) -> bool:
        """Whether each shard is its whole parameter on the device, so that a gather is a view or a cast
        (world size 1), with no communication to overlap."""
        return world == 1

    def derive_from_master(self, optimizer: OptimizerHome) -> bool:
        """Whether a trainable shard is cast from the master partition where needed rather than stored: with
        the master on the device, a stored 16-bit copy would only hold memory between uses."""
        return not optimizer.on_host

    def stage(self, transfer, shards: list[torch.Tensor], device: torch.device):
        """The shards in one device tensor for a gather, and an event to wait for before reading it (None)."""
        return (shards[0] if len(shards) == 1 else torch.cat(shards)), None

    def device_elements(self, shards) -> int:
        """How many of the stored ``shards``' elements are in device memory."""
        return sum(s.numel() for s in shards if s is not None)


class ShardsOnHost:
    """``offload_param``: stage-3 shards in one host buffer from ``host``, copied up for each gather beside
    the compute stream's kernels (see :meth:`.offload.HostTransfer.upload_shards`)."""

    on_host = True

    def __init__(self, device: torch.device, host):
        self.device = device
        self.host = host

    def homes(self, sizes: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        # views of one host buffer: one allocation at its exact size (see offload.HostBuffers on what a
        # runtime's pinned allocator rounds a block up to) and one registration
        return list(self.host.empty(sum(sizes), dtype).split(sizes))

    def in_place(self, world: int) -> bool:
        return False

    def derive_from_master(self, optimizer: OptimizerHome) -> bool:
        return False

    def stage(self, transfer, shards: list[torch.Tensor], device: torch.device):
        return transfer.upload_shards(shards, device)

    def device_elements(self, shards) -> int:
        return 0


OptimizerHome = OptimizerOnDevice | OptimizerOnHost
ShardsHome = ShardsOnDevice | ShardsOnHost


@dataclass(frozen=True)
class Placement:
    """Where the optimizer (``optimizer``) and the stage-3 parameter shards (``shards``) live."""

    optimizer: OptimizerHome
    shards: ShardsHome


def choose_placement(config, device: torch.device, host) -> Placement:
    """The placement the ``offload_optimizer`` and ``offload_param`` sections of a
    :class:`~.config.ZeroConfig` ask for; ``host`` gives the host memory."""
    opt_cfg = config.offload_optimizer
    if opt_cfg.enabled:
        optimizer = OptimizerOnHost(device, host, opt_cfg.overlap_step, opt_cfg.ratio)
    else:
        optimizer = OptimizerOnDevice(device)
    shards = ShardsOnHost(device, host) if config.offload_param.enabled else ShardsOnDevice(device)
    return Placement(optimizer, shards)
