"""A device mesh for data x sequence x tensor x expert parallelism, on torch's ``DeviceMesh``.

Layout (ranks in row-major order over the mesh ``(replica, expert, sequence, tensor)``, so
``rank = ((replica * expert_size + expert) * sequence_size + sequence) * tensor_size + tensor``):

- ``tensor`` is the innermost dimension, so a tensor-parallel group holds adjacent ranks
  (the ones sharing the fastest links, usually one node);
- ``sequence`` comes next: the ranks of a sequence group (which exchange activations in every
  attention layer, Ulysses' all-to-all) are the nearest after the tensor ranks. They hold one
  batch between them (each a contiguous part of every sequence of the same rows);
- ``data`` = ``replica`` x ``expert`` x ``sequence``: every rank that holds a copy of a dense
  parameter. ZeRO partitions over it and sums dense gradients over it. Sequence ranks are
  data replicas of every parameter: their gradients are partial sums of one batch's gradient;
- ``batch`` = ``replica`` x ``expert``: the ranks that see different batches (the rows a data
  loader shards over). ``size("batch")`` is the number of distinct batches, the divisor that turns
  the sum of the gradients over ``data`` into their mean over batches. Without sequence
  parallelism ``batch`` is ``data``;
- expert parallelism is carved out of the batch ranks, as MoE training does: experts are spread
  over an ``expert`` group; the replicas of one expert shard form an ``expert_data`` group
  (``replica`` x ``sequence``), over which expert gradients are summed.

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

DIMS = ("data", "tensor", "expert", "expert_data", "sequence", "batch")


@dataclass(frozen=True)
class ParallelMesh:
    """The mesh and its views; ``group(dim)`` gives this rank's process group for a dimension."""

    mesh: DeviceMesh  # dims ("replica", "expert", "sequence", "tensor")
    data: int
    tensor: int
    expert: int
    data_mesh: DeviceMesh | None = None  # the flattened (replica, expert, sequence) view, kept from its creation
    sequence: int = 1
    expert_data_mesh: DeviceMesh | None = None  # the flattened (replica, sequence) view
    batch_mesh: DeviceMesh | None = None  # the flattened (replica, expert) view

    @property
    def expert_data(self) -> int:
        return self.data // self.expert

    @property
    def batch(self) -> int:
        return self.data // self.sequence

    def submesh(self, dim: str) -> DeviceMesh:
        _check_dim(dim)
        if dim == "data":
            return self.data_mesh if self.data_mesh is not None else self.mesh["data"]
        if dim in ("expert_data", "batch"):
            flat = self.expert_data_mesh if dim == "expert_data" else self.batch_mesh
            return flat if flat is not None else self.mesh[dim]
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


def init_parallel_mesh(data: int = -1, tensor: int = 1, expert: int = 1, sequence: int = 1,
                       device_type: str | None = None) -> ParallelMesh:
    """Build the mesh over the whole world (initialising ``polyaccel.comm`` if needed).

    ``data=-1`` takes whatever the world leaves after ``tensor``; ``sequence`` must divide ``data`` and
    ``expert`` the batch ranks ``data / sequence``. ``device_type`` defaults to the selected accelerator's.
    """
    if not is_initialized():
        init_distributed()
    world = get_world_size()
    tensor = _positive("tensor", tensor)
    expert = _positive("expert", expert)
    sequence = _positive("sequence", sequence)
    if world % tensor:
        raise ConfigError(f"tensor={tensor} does not divide the world size {world}")
    if data == -1:
        data = world // tensor
    data = _positive("data", data)
    if data * tensor != world:
        raise ConfigError(f"data x tensor = {data} x {tensor} = {data * tensor} but the world has {world} ranks; "
                          "pass data=-1 to infer it")
    if data % sequence:
        raise ConfigError(f"sequence={sequence} must divide data={data} (world {world} / tensor {tensor}: sequence "
                          "ranks are data replicas holding parts of one batch); sequence sizes that fit: "
                          f"{[d for d in range(1, data + 1) if data % d == 0]}")
    batch = data // sequence
    if batch % expert:
        where = f"data={data}" if sequence == 1 else f"the batch ranks data / sequence = {data} / {sequence} = {batch}"
        raise ConfigError(f"expert={expert} must divide {where} (world {world} / tensor {tensor}: expert "
                          "parallelism is carved out of data parallelism); expert sizes that fit: "
                          f"{[d for d in range(1, batch + 1) if batch % d == 0]}")
    if device_type is None:
        device_type = current().accelerator().device_type
    mesh = init_device_mesh(device_type, (batch // expert, expert, sequence, tensor),
                            mesh_dim_names=("replica", "expert", "sequence", "tensor"))
    flat_data = mesh["replica", "expert", "sequence"]._flatten("data")
    return ParallelMesh(mesh=mesh, data=data, tensor=tensor, expert=expert, data_mesh=flat_data, sequence=sequence,
                        expert_data_mesh=mesh["replica", "sequence"]._flatten("expert_data"),
                        batch_mesh=mesh["replica", "expert"]._flatten("batch"))
