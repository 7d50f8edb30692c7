"""Argument checks of the collectives, made before anything is sent (a bad call fails on every rank alike)."""

from __future__ import annotations

import operator

import torch

from .errors import CommArgumentError


def bad(op: str, message: str):
    """Raise the :class:`CommArgumentError` of ``polyaccel.comm.<op>``."""
    raise CommArgumentError(f"polyaccel.comm.{op}: {message}")


def check_same_dtype(op: str, out_name: str, output: torch.Tensor, in_name: str, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        bad(op, f"{out_name} has dtype {output.dtype} but {in_name} has dtype {input.dtype}; "
                f"allocate {out_name} with dtype={input.dtype}")


def check_splits(op: str, name: str, splits, tensor: torch.Tensor, tensor_name: str, world: int) -> None:
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if rows % world:
            bad(op, f"{tensor_name} has {rows} rows, not divisible by the group size {world}; "
                    f"pass {name} explicitly")
        return
    try:
        splits = [operator.index(s) for s in splits]
    except TypeError:
        bad(op, f"{name} must be a list of non-negative ints, got {splits!r}")
    if len(splits) != world:
        bad(op, f"{name} has {len(splits)} entries but the group has {world} ranks; give one size per rank")
    if any(s < 0 for s in splits):
        bad(op, f"{name} must be non-negative ints, got {splits}")
    if sum(splits) != rows:
        bad(op, f"{name} {splits} sums to {sum(splits)} but {tensor_name} has {rows} rows (dim 0); "
                "the sizes must add up to dim 0")
