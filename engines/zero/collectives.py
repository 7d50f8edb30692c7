"""The few collectives the engine issues, all through ``polyaccel.comm``.

Small helpers that put scalars on the device the communication backend expects (the
accelerator's device) and hand back to the tensor's own device.
"""

from __future__ import annotations

import torch


def comm():
    from polyaccel import comm as _comm

    return _comm


class Collectives:
    def __init__(self, device: torch.device, group=None):
        self.device = device
        self.group = group
        c = comm()
        self.rank = c.get_rank(group)
        self.world = c.get_world_size(group)

    def global_ranks(self) -> list[int]:
        """The world ranks of this group, in group-rank order."""
        import torch.distributed as dist

        return list(range(self.world)) if self.group is None else dist.get_process_group_ranks(self.group)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        c = comm()
        return c.reduce_scatter_tensor(out, inp, op=c.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        return comm().all_gather_into_tensor(out, inp, group=self.group, async_op=async_op)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce a copy of ``t`` on the comm device; returns it on ``t``'s device. In a group of one the copy
        is the result: no trip to the comm device and back (each direction would wait for the device)."""
        if self.world == 1:
            return t.detach().clone()
        c = comm()
        work = t.detach().to(self.device, copy=True)
        c.all_reduce(work, op=c.ReduceOp.MAX if op == "max" else c.ReduceOp.SUM, group=self.group)
        return work.to(t.device)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        work = t.detach().to(self.device, copy=True)
        comm().broadcast(work, src=src, group=self.group)
        return work.to(t.device)

    def barrier(self) -> None:
        comm().barrier(group=self.group)
