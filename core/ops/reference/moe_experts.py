"""The expert MLP of a MoE layer as two ops, so that a builder can fuse the steps around its GEMMs.

``moe_gate_up`` is the dispatch gather, the gate/up grouped GEMM and SwiGLU; ``moe_down_combine``
is the down grouped GEMM and the router-weighted sum over each token's k slots. Both take the
``index`` that :func:`gather_sum` takes ([tokens, k], a permutation of the routed rows), so the
dispatch and the combine are described by the same tensor. The references compose the
reference ``grouped_mm``, ``swiglu`` and ``gather_sum``; a fused builder (the cuda plugin's)
must give the same numbers within the dtype's rounding.
"""

from __future__ import annotations

import torch

from ...errors import OpArgumentError
from .gather_sum import check_gather_sum_args, check_gather_sum_shapes, gather_sum
from .grouped_mm import check_grouped_mm_shapes, grouped_mm
from .swiglu import swiglu


def check_moe_gate_up_shapes(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                             offsets: torch.Tensor) -> None:
    """The checks of ``moe_gate_up`` that need no look at the index's or offsets' values."""
    if x.dim() != 2 or not x.is_floating_point():
        raise OpArgumentError(f"moe_gate_up: x must be a 2-D floating-point tensor [tokens, H], got {x.dim()}-D "
                              f"{x.dtype}")
    if index.dim() != 2 or index.dtype not in (torch.int32, torch.int64) or index.shape[0] != x.shape[0]:
        raise OpArgumentError(f"moe_gate_up: index must be an int32/int64 [tokens, k] tensor with the {x.shape[0]} "
                              f"tokens of x, got {index.dtype}{tuple(index.shape)}")
    if weight.dim() == 3 and weight.shape[2] % 2:
        raise OpArgumentError(f"moe_gate_up: weight's last dimension holds gate then up and must be even, got "
                              f"{weight.shape[2]}")
    try:
        # the routed rows [index.numel(), H] in x's dtype; grouped_mm's shape check reads only their width and
        # dtype (its rows are the offsets' to bound, by value), which x has: x stands for them, not a made tensor
        check_grouped_mm_shapes(x, weight, offsets)
    except OpArgumentError as e:
        raise OpArgumentError(f"moe_gate_up: {e}") from None
    for name, t in (("index", index), ("weight", weight), ("offsets", offsets)):
        if t.device != x.device:
            raise OpArgumentError(f"moe_gate_up: {name} is on {t.device} but x is on {x.device}; pass one device")


def check_moe_down_combine_shapes(h: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                                  index: torch.Tensor, weights: torch.Tensor | None) -> None:
    """The checks of ``moe_down_combine`` that need no look at the index's or offsets' values."""
    if h.dim() != 2 or not h.is_floating_point():
        raise OpArgumentError(f"moe_down_combine: h must be a 2-D floating-point tensor [rows, F], got {h.dim()}-D "
                              f"{h.dtype}")
    try:
        check_grouped_mm_shapes(h, weight, offsets)
        check_gather_sum_shapes(h, index, weights)
    except OpArgumentError as e:
        raise OpArgumentError(f"moe_down_combine: {e}") from None
    for name, t in (("weight", weight), ("offsets", offsets)):
        if t.device != h.device:
            raise OpArgumentError(f"moe_down_combine: {name} is on {t.device} but h is on {h.device}; pass one device")


def routed_tokens(index: torch.Tensor) -> torch.Tensor:
    """``tok`` [tokens * k] int64: the token whose slot routed row ``r`` is (``tok[index[t, j]] = t``)."""
    T, k = index.shape
    tok = torch.empty(T * k, dtype=torch.int64, device=index.device)
    tok[index.reshape(-1).long()] = torch.arange(T, device=index.device).repeat_interleave(k)
    return tok


def moe_gate_up(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Dispatch, gate/up grouped GEMM and SwiGLU of a MoE layer; returns a new `[tokens * k, F]`.

    Called as `fn(x, index, weight, offsets)`. `x` is `[tokens, H]` (token order), `index`
    is `[tokens, k]` as `gather_sum` takes it (every routed row number `0..tokens*k-1`
    exactly once: token `t`'s slot `j` is routed row `index[t, j]`), `weight` is
    `[experts, H, 2F]` of `x`'s dtype (gate columns first, then up), `offsets` the
    cumulative end row of each expert over the routed rows, as `grouped_mm` takes it. Then

        routed[index[t, j]] = x[t]
        gate, up = grouped_mm(routed, weight, offsets).chunk(2, -1)
        out = swiglu(gate, up)            (rows past the last offset are zero)

    with `grouped_mm`'s and `swiglu`'s rounding (the GEMM's result rounded to `x`'s dtype
    before SwiGLU). Differentiable with respect to `x` and `weight`. A builder may gather
    `x`'s rows as it loads them and apply SwiGLU in the GEMM's epilogue; it may skip the
    checks that need the index's or offsets' values.
    """
    check_moe_gate_up_shapes(x, index, weight, offsets)
    try:
        check_gather_sum_args(x.new_empty((index.numel(), 0)), index, None)
    except OpArgumentError as e:
        raise OpArgumentError(f"moe_gate_up: {str(e).removeprefix('gather_sum: ')}") from None
    routed = x.index_select(0, routed_tokens(index))
    gate, up = grouped_mm(routed, weight, offsets).chunk(2, dim=-1)
    return swiglu(gate, up)


def moe_down_combine(h: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor,
                     weights: torch.Tensor | None = None) -> torch.Tensor:
    """Down grouped GEMM and the weighted sum over each token's k slots; returns a new `[tokens, H]`.

    Called as `fn(h, weight, offsets, index, weights=None)`: `h` is `[rows, F]` sorted by
    expert, `weight` `[experts, F, H]`, `offsets` as `grouped_mm` takes them, `index` and
    `weights` as `gather_sum` takes them (`[tokens, k]`, `tokens * k == rows`). Then

        out = gather_sum(grouped_mm(h, weight, offsets), index, weights)

    (the GEMM's rows rounded to `h`'s dtype, then weighted and summed in fp32 for 16-bit
    inputs). Differentiable with respect to `h`, `weight` and `weights`. A builder may weight
    the rows in the GEMM's epilogue and write each to its token's slot (one pass, no atomics:
    the index is a permutation), then sum the k slots.
    """
    check_moe_down_combine_shapes(h, weight, offsets, index, weights)
    return gather_sum(grouped_mm(h, weight, offsets), index, weights)
