"""The collectives: ``torch.distributed``'s signatures, checked arguments, the flag-tested direct path."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import dispatch, fallbacks
from .checks import bad, check_same_dtype, check_splits
from .dispatch import call, invoke, wrap
from .session import get_rank, get_timeout, get_world_size
from .staging import IN, INOUT, OUT

ReduceOp = dist.ReduceOp

# torch >= 2.10 renamed these two (the old names warn)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if dispatch.direct:
        return wrap("all_reduce", call("all_reduce", dist.all_reduce, tensor, op, group, async_op))
    return invoke("all_reduce", group, ((tensor, INOUT),), lambda ts, a: dist.all_reduce(ts[0], op, group, a),
                  async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    name = "reduce_scatter_tensor"
    check_same_dtype(name, "output", output, "input", input)
    world = get_world_size(group)
    if input.numel() != output.numel() * world:
        bad(name, f"input has {input.numel()} elements but must have output.numel() * group size = "
                  f"{output.numel()} * {world} = {output.numel() * world}")
    if name in dispatch.emulated:
        launch = lambda ts, a: fallbacks.reduce_scatter_tensor(ts[0], ts[1], op, group, dispatch.timeout_s)
    elif dispatch.direct:
        return wrap(name, call(name, _reduce_scatter, output, input, op, group, async_op))
    else:
        launch = lambda ts, a: _reduce_scatter(ts[0], ts[1], op, group, a)
    return invoke(name, group, ((output, OUT), (input, IN)), launch, async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                           async_op: bool = False):
    name = "all_gather_into_tensor"
    check_same_dtype(name, "output_tensor", output_tensor, "input_tensor", input_tensor)
    world = get_world_size(group)
    if output_tensor.numel() != input_tensor.numel() * world:
        bad(name, f"output_tensor has {output_tensor.numel()} elements but must have input_tensor.numel() * "
                  f"group size = {input_tensor.numel()} * {world} = {input_tensor.numel() * world}")
    if name in dispatch.emulated:
        launch = lambda ts, a: fallbacks.all_gather_into_tensor(ts[0], ts[1], group, dispatch.timeout_s)
    elif dispatch.direct:
        return wrap(name, call(name, _all_gather, output_tensor, input_tensor, group, async_op))
    else:
        launch = lambda ts, a: _all_gather(ts[0], ts[1], group, a)
    return invoke(name, group, ((output_tensor, OUT), (input_tensor, IN)), launch, async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False):
    """Uneven splits (including zeros) along dim 0; split lists are checked before anything is sent."""
    name = "all_to_all_single"
    check_same_dtype(name, "output", output, "input", input)
    world = get_world_size(group)
    check_splits(name, "input_split_sizes", input_split_sizes, input, "input", world)
    check_splits(name, "output_split_sizes", output_split_sizes, output, "output", world)
    if input.dim() and output.dim() and input.shape[1:] != output.shape[1:]:
        bad(name, f"output rows have shape {tuple(output.shape[1:])} but input rows {tuple(input.shape[1:])}; "
                  "all dims but the first must match")
    if name in dispatch.emulated:
        launch = lambda ts, a: fallbacks.all_to_all_single(ts[0], ts[1], output_split_sizes, input_split_sizes,
                                                           group, dispatch.timeout_s)
    elif dispatch.direct:
        return wrap(name, call(name, dist.all_to_all_single, output, input, output_split_sizes, input_split_sizes,
                               group, async_op))
    else:
        launch = lambda ts, a: dist.all_to_all_single(ts[0], ts[1], output_split_sizes, input_split_sizes, group, a)
    return invoke(name, group, ((output, OUT), (input, IN)), launch, async_op)


def broadcast(tensor: torch.Tensor, src: int | None = None, group=None, async_op: bool = False,
              group_src: int | None = None):
    if dispatch.direct:
        return wrap("broadcast", call("broadcast", dist.broadcast, tensor, src, group, async_op, group_src))
    is_src = get_rank(group) == group_src if src is None else get_rank() == src
    return invoke("broadcast", group, ((tensor, IN if is_src else OUT),),
                  lambda ts, a: dist.broadcast(ts[0], src, group, a, group_src=group_src), async_op)


def barrier(group=None, async_op: bool = False):
    if dispatch.direct:
        return wrap("barrier", call("barrier", dist.barrier, group, async_op))
    return invoke("barrier", group, (), lambda ts, a: dist.barrier(group, a), async_op)


def new_group(ranks=None, timeout=None, backend=None, **kwargs):
    """``torch.distributed.new_group`` that inherits this layer's timeout instead of torch's default."""
    return dist.new_group(ranks, timeout=timeout if timeout is not None else get_timeout(),
                          backend=backend, **kwargs)
