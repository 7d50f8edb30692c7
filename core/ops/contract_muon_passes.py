"""The contract checks of Muon's element-wise passes (``muon_momentum``, ``muon_apply``), run by their entry points.

The buffers are contiguous 1-D dense floating tensors on one device; the piece tables are lists of ints, equally
long, every piece inside its buffer; the pieces a call writes do not overlap one another, and a written buffer
shares no memory with another buffer of the call. Hyperparameters are finite and in range. Every check runs
before any builder is reached, so a refused call changes nothing.
"""

from __future__ import annotations

import math
import operator

import torch

from ..errors import OpArgumentError
from .contract import _number, _ranges_overlap, check_beta, check_lr

#: the momentum's dtypes (a 16-bit gradient's momentum is float32)
MOMENTUM_DTYPES = (torch.float32, torch.float64)
GRAD_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _flat(op: str, name: str, t, dtypes=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise OpArgumentError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.layout != torch.strided or not t.dtype.is_floating_point or t.dim() != 1 or not t.is_contiguous():
        raise OpArgumentError(f"{op}: {name} is a {t.layout} tensor of dtype {t.dtype}, shape {tuple(t.shape)}, "
                              f"strides {t.stride() if t.layout == torch.strided else '-'}; the op takes contiguous "
                              "1-D floating tensors (a flat buffer: pieces are offsets into it)")
    if dtypes is not None and t.dtype not in dtypes:
        raise OpArgumentError(f"{op}: {name} has dtype {t.dtype}; it must be one of "
                              f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)}")


def _one_device(op: str, names, tensors) -> None:
    device = tensors[0].device
    for name, t in zip(names[1:], tensors[1:], strict=True):
        if t.device != device:
            raise OpArgumentError(f"{op}: {name} is on {t.device} but {names[0]} is on {device}; one call takes "
                                  "tensors of one device")


def _int_list(op: str, name: str, values) -> list[int]:
    if not isinstance(values, (list, tuple)):
        raise OpArgumentError(f"{op}: {name} must be a list of ints, got {type(values).__name__}")
    if not all(type(v) is int for v in values):  # the common case, one C-level pass
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int):
                raise OpArgumentError(f"{op}: {name}[{i}]={v!r} is not an int")
    if values and min(values) < 0:
        i = min(range(len(values)), key=values.__getitem__)
        raise OpArgumentError(f"{op}: {name}[{i}]={values[i]} is negative; offsets and lengths are >= 0")
    return list(values)


def _pieces(op: str, offsets: dict, lengths, buffers: dict, written: tuple[str, ...]) -> list[int]:
    """Every table an int list as long as ``lengths``; every piece inside its buffer; no two pieces of a written
    buffer overlapping. ``offsets`` and ``buffers``: the offsets' name -> list, and -> the buffer they index."""
    lengths = _int_list(op, "lengths", lengths)
    for name, offs in offsets.items():
        offs = offsets[name] = _int_list(op, name, offs)
        if len(offs) != len(lengths):
            raise OpArgumentError(f"{op}: {name} has {len(offs)} entries but lengths has {len(lengths)}; "
                                  "pass one offset per piece in every table")
        size = buffers[name].numel()
        ends = list(map(operator.add, offs, lengths))
        if ends and max(ends) > size:
            i = max(range(len(ends)), key=ends.__getitem__)
            raise OpArgumentError(f"{op}: piece {i} ({name}[{i}]={offs[i]}, lengths[{i}]={lengths[i]}) ends at "
                                  f"{ends[i]}, past the {size} elements of its buffer")
        if name in written and _ranges_overlap(offs, ends):
            raise OpArgumentError(f"{op}: two pieces of {name} overlap; the op writes them, so each element may "
                                  "belong to one piece only")
    return lengths


def _no_shared_memory(op: str, names, tensors, written: set[str]) -> None:
    spans = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors]
    for i in range(len(tensors)):
        for j in range(i + 1, len(tensors)):
            if not (names[i] in written or names[j] in written):
                continue
            (a0, a1), (b0, b1) = spans[i], spans[j]
            if a0 < b1 and b0 < a1 and a1 > a0 and b1 > b0:
                raise OpArgumentError(f"{op}: {names[i]} and {names[j]} share memory and the op writes "
                                      f"{names[i] if names[i] in written else names[j]}; pass separate buffers")


def check_muon_momentum(grad, momentum_buffer, out, *, grad_offsets, buffer_offsets, out_offsets, lengths, momentum,
                        nesterov) -> None:
    op = "muon_momentum"
    check_beta(op, momentum, "momentum")
    if not isinstance(nesterov, bool):
        raise OpArgumentError(f"{op}: nesterov must be True or False, got {nesterov!r}")
    names = ("grad", "momentum_buffer", "out")
    _flat(op, "grad", grad, GRAD_DTYPES)
    _flat(op, "momentum_buffer", momentum_buffer, MOMENTUM_DTYPES)
    _flat(op, "out", out)
    _one_device(op, names, (grad, momentum_buffer, out))
    if grad.dtype == torch.float64 and momentum_buffer.dtype != torch.float64:
        raise OpArgumentError(f"{op}: grad is float64 but momentum_buffer is {momentum_buffer.dtype}; the momentum is "
                              "computed in the buffer's dtype, which would round the gradient (keep the buffer in "
                              "float64, or pass a float32 gradient)")
    _pieces(op, {"grad_offsets": grad_offsets, "buffer_offsets": buffer_offsets, "out_offsets": out_offsets},
            lengths, {"grad_offsets": grad, "buffer_offsets": momentum_buffer, "out_offsets": out},
            ("buffer_offsets", "out_offsets"))
    _no_shared_memory(op, names, (grad, momentum_buffer, out), {"momentum_buffer", "out"})


def _finite_list(op: str, name: str, values, n: int) -> None:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise OpArgumentError(f"{op}: {name} must be a list with one number per piece ({n}), got {count}")
    for i, v in enumerate(values):
        x = _number(op, f"{name}[{i}]", v)
        if not (math.isfinite(x) and x >= 0):
            raise OpArgumentError(f"{op}: {name}[{i}]={v!r} is not allowed; it must be a finite number >= 0")


def check_muon_apply(params, updates, *, param_offsets, update_offsets, lengths, lr, weight_decays,
                     lr_scales) -> None:
    op = "muon_apply"
    check_lr(op, lr)
    _flat(op, "params", params)
    _flat(op, "updates", updates)
    _one_device(op, ("params", "updates"), (params, updates))
    if updates.dtype.itemsize > params.dtype.itemsize:
        raise OpArgumentError(f"{op}: updates are {updates.dtype}, wider than params ({params.dtype}); the update "
                              "is applied in the params' dtype, so pass it in that dtype or a narrower one")
    n = len(_pieces(op, {"param_offsets": param_offsets, "update_offsets": update_offsets}, lengths,
                    {"param_offsets": params, "update_offsets": updates}, ("param_offsets",)))
    _finite_list(op, "weight_decays", weight_decays, n)
    _finite_list(op, "lr_scales", lr_scales, n)
    _no_shared_memory(op, ("params", "updates"), (params, updates), {"params"})


__all__ = ["GRAD_DTYPES", "MOMENTUM_DTYPES", "check_muon_apply", "check_muon_momentum"]
