"""A device mesh for data x tensor x expert parallelism, on torch's ``DeviceMesh``.

Layout (ranks in row-major order over the mesh ``(expert_data, expert, tensor)``):

- ``tensor`` is the innermost dimension, so a tensor-parallel group holds adjacent ranks
  (the ones sharing the fastest links, usually one node);
- ``data`` = ``expert_data`` x ``expert``: expert parallelism is carved out of data
  parallelism, as MoE training does. Experts are spread over an ``expert`` group; the
  replicas of one expert shard form an ``expert_data`` group, over which expert gradients
  are reduced. Dense gradients are reduced over ``data``.

>>> mesh = init_parallel_mesh(tensor=2, expert=2)        # on 8 ranks: data=4, expert_data=2
>>> mesh.group("tensor"), mesh.size("data"), mesh.rank("expert")
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import ConfigError
from ..runtime import current
from .session import get_world_size, init_distributed, is_initialized

DIMS = ("data", "tensor", "expert", "expert_data")


@dataclass(frozen=True)
class ParallelMesh:
    """The mesh and its four views; ``group(dim)`` gives this rank's process group for a dimension."""

    mesh: DeviceMesh  # dims ("expert_data", "expert", "tensor")
    data: int
    tensor: int
    expert: int
    data_mesh: DeviceMesh | None = None  # the flattened (expert_data, expert) view, kept from its creation

    @property
    def expert_data(self) -> int:
        return self.data // self.expert

    def submesh(self, dim: str) -> DeviceMesh:
        _check_dim(dim)
        if dim == "data":  # the flattened (expert_data, expert) view
            return self.data_mesh if self.data_mesh is not None else self.mesh["data"]
        return self.mesh[dim]

    def group(self, dim: str):
        return self.submesh(dim).get_group()

    def size(self, dim: str) -> int:
        _check_dim(dim)
        return getattr(self, dim)

    def rank(self, dim: str) -> int:
        return self.submesh(dim).get_local_rank()

    def ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along ``dim``."""
        return dist.get_process_group_ranks(self.group(dim))


def _check_dim(dim: str) -> None:
    if dim not in DIMS:
        raise ConfigError(f"unknown mesh dimension {dim!r}; the dimensions are {list(DIMS)}")


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def init_parallel_mesh(data: int = -1, tensor: int = 1, expert: int = 1,
                       device_type: str | None = None) -> ParallelMesh:
    """Build the mesh over the whole world (initialising ``polyaccel.comm`` if needed).

    ``data=-1`` takes whatever the world leaves after ``tensor``; ``expert`` must divide ``data``.
    ``device_type`` defaults to the selected accelerator's.
    """
    if not is_initialized():
        init_distributed()
    world = get_world_size()
    tensor = _positive("tensor", tensor)
    expert = _positive("expert", expert)
    if world % tensor:
        raise ConfigError(f"tensor={tensor} does not divide the world size {world}")
    if data == -1:
        data = world // tensor
    data = _positive("data", data)
    if data * tensor != world:
        raise ConfigError(f"data x tensor = {data} x {tensor} = {data * tensor} but the world has {world} ranks; "
                          "pass data=-1 to infer it")
    if data % expert:
        raise ConfigError(f"expert={expert} must divide data={data} (world {world} / tensor {tensor}: expert "
                          "parallelism is carved out of data parallelism); expert sizes that fit: "
                          f"{[d for d in range(1, data + 1) if data % d == 0]}")
    if device_type is None:
        device_type = current().accelerator().device_type
    mesh = init_device_mesh(device_type, (data // expert, expert, tensor),
                            mesh_dim_names=("expert_data", "expert", "tensor"))
    flat = mesh["expert_data", "expert"]._flatten("data")
    return ParallelMesh(mesh=mesh, data=data, tensor=tensor, expert=expert, data_mesh=flat)
