"""Gather-sum for expert layers: each token's k routed rows, gathered and summed (optionally weighted).

The combine step of a MoE layer (and the backward of its dispatch): the rows that came back from
the experts are in expert order; each token sums its k rows, times the router weights.
"""

from __future__ import annotations

import torch

from ...errors import OpArgumentError
from .optimizers import upcast


def check_gather_sum_shapes(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None) -> None:
    """Validate what needs no look at the index's values (no synchronisation)."""
    if rows.dim() != 2 or not rows.is_floating_point():
        raise OpArgumentError(f"gather_sum: rows must be a 2-D floating-point tensor, got {rows.dim()}-D "
                              f"{rows.dtype}")
    if index.dim() != 2 or index.dtype not in (torch.int32, torch.int64):
        raise OpArgumentError(f"gather_sum: index must be a 2-D int32/int64 tensor [tokens, k], got {index.dim()}-D "
                              f"{index.dtype}")
    if index.numel() != rows.shape[0]:
        raise OpArgumentError(f"gather_sum: index {tuple(index.shape)} must name each of the {rows.shape[0]} rows "
                              f"once (tokens * k == rows), it has {index.numel()} entries")
    if index.device != rows.device:
        raise OpArgumentError(f"gather_sum: index is on {index.device} but rows are on {rows.device}")
    if weights is None:
        return
    if weights.shape != index.shape or not weights.is_floating_point():
        raise OpArgumentError(f"gather_sum: weights must be floating point and shaped like index "
                              f"{tuple(index.shape)}, got {weights.dtype}{tuple(weights.shape)}")
    if weights.device != rows.device:
        raise OpArgumentError(f"gather_sum: weights are on {weights.device} but rows are on {rows.device}")


def check_gather_sum_args(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None) -> None:
    """The shape checks, then the index's values: a permutation of the rows (one read to the host)."""
    check_gather_sum_shapes(rows, index, weights)
    if not index.numel():
        return
    host = index.reshape(-1).long().cpu()
    n = rows.shape[0]
    if int(host.min()) < 0 or int(host.max()) >= n or bool((torch.bincount(host, minlength=n) != 1).any()):
        raise OpArgumentError(f"gather_sum: index must hold every row number 0..{n - 1} exactly once "
                              "(a permutation of the rows, laid out [tokens, k])")


def gather_sum_forward(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    T, k = index.shape
    per_slot = upcast(rows).index_select(0, index.reshape(-1).long()).view(T, k, rows.shape[1])
    if weights is not None:
        per_slot = per_slot * upcast(weights).unsqueeze(-1)
    return per_slot.sum(dim=1).to(rows.dtype)


def gather_sum_backward(grad_out: torch.Tensor, rows: torch.Tensor | None, index: torch.Tensor,
                        weights: torch.Tensor | None, need_d_weights: bool):
    """Return (d_rows, d_weights or None); ``rows`` is needed only for ``d_weights``."""
    T, k = index.shape
    flat = index.reshape(-1).long()
    go = upcast(grad_out).unsqueeze(1).expand(T, k, grad_out.shape[1])
    per_slot = go if weights is None else go * upcast(weights).unsqueeze(-1)
    d_rows = torch.empty((T * k, grad_out.shape[1]), dtype=grad_out.dtype, device=grad_out.device)
    d_rows[flat] = per_slot.reshape(T * k, grad_out.shape[1]).to(grad_out.dtype)
    d_weights = None
    if need_d_weights:
        gathered = upcast(rows).index_select(0, flat).view(T, k, rows.shape[1])
        d_weights = (gathered * go).sum(dim=-1).to(weights.dtype)
    return d_rows, d_weights


def make_gather_sum(forward, backward, check=check_gather_sum_shapes):
    """Build an autograd-aware gather_sum op from a forward and a backward kernel.

    ``forward(rows, index, weights) -> out`` and ``backward(grad_out, rows, index, weights,
    need_d_weights) -> (d_rows, d_weights)`` compute the reference's math
    (:func:`gather_sum_forward`, :func:`gather_sum_backward`) any way they like; ``grad_out``
    arrives contiguous, ``rows`` is None unless ``need_d_weights``. ``check(rows, index,
    weights)`` validates the arguments (by default the checks that need no synchronisation).
    """

    class _GatherSum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows, index, weights):
            need_d_weights = weights is not None and ctx.needs_input_grad[2]
            ctx.save_for_backward(rows if need_d_weights else None, index, weights)
            return forward(rows, index, weights)

        @staticmethod
        def backward(ctx, grad_out):
            rows, index, weights = ctx.saved_tensors
            d_rows, d_weights = backward(grad_out.contiguous(), rows, index, weights, ctx.needs_input_grad[2])
            return d_rows if ctx.needs_input_grad[0] else None, None, d_weights

    def gather_sum(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        check(rows, index, weights)
        return _GatherSum.apply(rows, index, weights)

    return gather_sum


gather_sum = make_gather_sum(gather_sum_forward, gather_sum_backward, check=check_gather_sum_args)
gather_sum.__doc__ = """Each token's k rows gathered and summed, optionally weighted; returns a new `[tokens, H]`.

    Called as `fn(rows, index, weights=None)`. `rows` is `[N, H]`, floating point. `index`
    (int32 or int64, `[tokens, k]`, `tokens * k == N`) holds every row number exactly once:
    row `index[t, j]` is token `t`'s slot `j`. `weights` is None or `[tokens, k]`, floating
    point (any float dtype). Then

        out[t] = sum_j weights[t, j] * rows[index[t, j]]      (weights[t, j] = 1 when None)

    in `rows`' dtype, the products and the sum in fp32 for 16-bit inputs. Differentiable with
    respect to `rows` and `weights`:

        d_rows[index[t, j]] = weights[t, j] * grad_out[t]
        d_weights[t, j]     = dot(rows[index[t, j]], grad_out[t])     (in `weights`' dtype)

    The reference checks that `index` is a permutation (one read to the host); builders may
    skip that check, and what they do with a repeated or out-of-range entry is undefined.
    Build a builder's function with `make_gather_sum(forward, backward)` (from
    `polyaccel.ops.reference`): it supplies the autograd wiring and the checks that need
    no synchronisation.
    """
