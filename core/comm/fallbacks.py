"""Fallback collectives built from others, for backends that lack them.

A backend lists the collectives it lacks in ``CommHooks.emulated_collectives``; ``polyaccel.comm``
then runs the fallback here and reports the collective as emulated. Each fallback is asynchronous
and returns a :class:`CommHandle` whose ``wait()`` finishes the job; it never modifies the
caller's input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .handles import CommHandle


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op, group, timeout_s) -> CommHandle:
    """All-reduce a copy of the whole input, then keep this rank's slice."""
    reduced = input.detach().clone()
    work = dist.all_reduce(reduced, op, group, async_op=True)
    rank = dist.get_rank(group)
    n = output.numel()

    def finalize() -> None:
        output.copy_(reduced.reshape(-1)[rank * n:(rank + 1) * n].view(output.shape))

    return CommHandle("reduce_scatter_tensor", [work], finalize, timeout_s)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group, timeout_s) -> CommHandle:
    """All-gather into per-rank views of the output (through a scratch buffer if it is not contiguous)."""
    target = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    views = list(target.view(-1).split(input.numel()))  # one per rank: the caller checked the sizes
    work = dist.all_gather(views, input.contiguous().view(-1), group, async_op=True)
    finalize = None if target is output else (lambda: output.copy_(target))
    return CommHandle("all_gather_into_tensor", [work], finalize, timeout_s)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes, input_split_sizes, group,
                      timeout_s) -> CommHandle:
    """Exchange the splits with batched isend/irecv; the own split is a local copy."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if input_split_sizes is None:
        input_split_sizes = [input.shape[0] // world] * world
    if output_split_sizes is None:
        output_split_sizes = [output.shape[0] // world] * world
    target = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    sends = torch.split(input.contiguous(), list(input_split_sizes))
    recvs = torch.split(target, list(output_split_sizes))
    ops = []
    for peer in range(world):
        if peer == rank:
            recvs[peer].copy_(sends[peer])
            continue
        peer_global = dist.get_global_rank(group, peer) if group is not None else peer
        if sends[peer].numel():
            ops.append(dist.P2POp(dist.isend, sends[peer], peer_global, group))
        if recvs[peer].numel():
            ops.append(dist.P2POp(dist.irecv, recvs[peer], peer_global, group))
    works = dist.batch_isend_irecv(ops) if ops else []
    finalize = None if target is output else (lambda: output.copy_(target))
    return CommHandle("all_to_all_single", works, finalize, timeout_s)
