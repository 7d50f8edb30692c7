"""The op contract's argument checks: what ``polyaccel.ops.<op>`` validates before any builder runs.

The entry points in :mod:`polyaccel.ops` call these once per call, so every builder sees
only calls the contract allows and a bad call fails the same way on every device, with
every tensor untouched. The checks *validate*; they never convert: builders receive the
caller's tensors as they are (any strides, storage offsets, expanded read-only operands),
and handling a layout their kernel cannot take is each builder's job
(:mod:`polyaccel.ops.layout` stages such tensors through dense copies).

Optimizer calls (``fused_adam``, ``fused_lion``, ``fused_lamb``):

* the tensor lists are equally long; entry ``i`` of every list has one shape; every tensor
  is a strided floating-point tensor on one device (the first param's);
* a tensor the op writes (params and states) has no internal overlap (no expanded /
  stride-0 dimension) and shares no memory with any other tensor of the call: two list
  entries that alias each other would make the result depend on the kernel's order;
* hyperparameters are real numbers (not tensors: reading a device tensor would sync):
  ``lr``, ``eps`` and ``weight_decay`` finite, ``lr >= 0``, ``weight_decay >= 0``,
  ``eps > 0``, each beta in ``[0, 1)``, LAMB's ``0 < min_coeff <= max_coeff`` (``max_coeff``
  may be ``inf``: no upper bound);
* ``step`` >= 1: an int or float, or a one-element integer / floating tensor on the host or
  on the params' device. A host tensor's value is checked (reading it costs no device
  synchronisation); a device tensor's value is not read (a captured graph advances it).

The cost is a few attribute reads per tensor and one sort of the written tensors' address
ranges; layouts that need more (a non-contiguous written tensor, two overlapping address
ranges) take an exact check that runs only for them.
"""

from __future__ import annotations

import math
import operator
from numbers import Real

import torch

from ..errors import OpArgumentError

ADAM_LISTS = ("params", "grads", "exp_avgs", "exp_avg_sqs")
LION_LISTS = ("params", "grads", "exp_avgs")
#: indices of the lists the optimizer ops write (all but the grads)
WRITTEN = frozenset((0, 2, 3))


# ----------------------------------------------------------------------------- hyperparameters
def _number(op: str, name: str, value) -> float:
    if type(value) is float or type(value) is int:  # the common case, without the ABC check
        return float(value)
    if isinstance(value, bool) or not isinstance(value, Real):
        kind = "a tensor (reading a device tensor would synchronise; pass float(...))" if isinstance(
            value, torch.Tensor) else type(value).__name__
        raise OpArgumentError(f"{op}: {name} must be a real number, got {kind}")
    return float(value)


def _refuse(op: str, name: str, value, allowed: str) -> None:
    raise OpArgumentError(f"{op}: {name}={value!r} is not allowed; {name} must be {allowed}")


def check_lr(op: str, lr, name: str = "lr") -> None:
    v = _number(op, name, lr)
    if not (math.isfinite(v) and v >= 0):
        _refuse(op, name, lr, "a finite number >= 0 (the learning rate)")


def check_weight_decay(op: str, weight_decay, name: str = "weight_decay") -> None:
    v = _number(op, name, weight_decay)
    if not (math.isfinite(v) and v >= 0):
        _refuse(op, name, weight_decay, "a finite number >= 0")


def check_eps(op: str, eps, name: str = "eps") -> None:
    v = _number(op, name, eps)
    if not (math.isfinite(v) and v > 0):
        _refuse(op, name, eps, "a finite number > 0")


def check_beta(op: str, beta, name: str) -> None:
    v = _number(op, name, beta)
    if not 0.0 <= v < 1.0:  # NaN fails the comparison
        _refuse(op, name, beta, "in [0, 1)")


def check_trust_bounds(op: str, min_coeff, max_coeff) -> None:
    lo = _number(op, "min_coeff", min_coeff)
    hi = _number(op, "max_coeff", max_coeff)
    if not (math.isfinite(lo) and lo > 0):
        _refuse(op, "min_coeff", min_coeff, "a finite number > 0 (the trust-ratio lower bound)")
    if not hi >= lo:  # NaN fails the comparison; inf is no upper bound
        raise OpArgumentError(f"{op}: max_coeff={max_coeff!r} is not allowed; the trust-ratio bounds need "
                              f"0 < min_coeff <= max_coeff (min_coeff={min_coeff!r})")


def check_step(op: str, step, device: torch.device | None) -> None:
    """``step`` >= 1; a tensor step's dtype, shape and device are checked, its value only on the host."""
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.dim() > 1:
            raise OpArgumentError(f"{op}: step must be a number or a 0-d tensor, got a tensor of shape "
                                  f"{tuple(step.shape)}")
        if step.dtype == torch.bool or step.dtype.is_complex:
            raise OpArgumentError(f"{op}: step tensor has dtype {step.dtype}; use an integer or floating dtype")
        if step.device.type == "cpu":
            value = step.item()  # a host tensor: no device synchronisation
        elif device is not None and step.device != device:
            raise OpArgumentError(f"{op}: step tensor is on {step.device} but the parameters are on {device}; "
                                  "keep it on the parameters' device (a captured graph reads it there) or the host")
        else:
            return  # on the device: never read here
    else:
        value = _number(op, "step", step)
    if not (math.isfinite(value) and value >= 1):
        _refuse(op, "step", step.item() if isinstance(step, torch.Tensor) else step,
                "a finite number >= 1 (the step count after incrementing: 1 on the first step)")


# ----------------------------------------------------------------------------- tensor lists
_device = operator.attrgetter("device")
_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_layout = operator.attrgetter("layout")
_nbytes = operator.attrgetter("nbytes")
_ptr, _is_contiguous = torch.Tensor.data_ptr, torch.Tensor.is_contiguous


def check_optimizer_tensors(op: str, names: tuple[str, ...], lists, written=WRITTEN) -> torch.device | None:
    """Lengths, shapes, dtypes, one device, and no memory a written tensor shares; returns the device.

    Per list, the common case is a handful of C-level passes (``map`` over attribute reads), inline here
    because this runs on every optimizer step; a per-tensor Python loop runs only to name a bad tensor
    (the ``_refuse_*`` helpers) or for non-contiguous written ones.
    """
    n = _check_list_lengths(op, names, lists)
    if n == 0:
        return None
    for li, lst in enumerate(lists):
        if not all(issubclass(k, torch.Tensor) for k in set(map(type, lst))):
            _refuse_non_tensor(op, names[li], lst)
    device = lists[0][0].device
    shapes = list(map(_shape, lists[0]))
    starts: list[int] = []
    ends: list[int] = []
    for li, lst in enumerate(lists):
        if any(d != device for d in set(map(_device, lst))):
            _refuse_other_device(op, names, li, lst, device)
        if li and list(map(_shape, lst)) != shapes:
            _refuse_other_shape(op, names, li, lst, shapes)
        if not (all(d.is_floating_point for d in set(map(_dtype, lst)))
                and set(map(_layout, lst)) == {torch.strided}):
            _refuse_not_dense_floating(op, names[li], lst)
        ptrs = list(map(_ptr, lst))
        if all(map(_is_contiguous, lst)):
            sizes = list(map(_nbytes, lst))
        else:
            sizes = _strided_extents(op, names[li], lst, li in written)
        starts += ptrs
        ends += map(operator.add, ptrs, sizes)
    if _ranges_overlap(starts, ends):
        _check_no_aliasing(op, names, lists, written)
    return device


def _check_list_lengths(op: str, names, lists) -> int:
    """Every argument is a list (or tuple), all equally long; returns the length."""
    for name, lst in zip(names, lists, strict=True):
        if not isinstance(lst, (list, tuple)):
            raise OpArgumentError(f"{op}: {name} must be a list of tensors, got {type(lst).__name__}")
    n = len(lists[0])
    if any(len(lst) != n for lst in lists):
        counts = ", ".join(f"{name}: {len(lst)}" for name, lst in zip(names, lists, strict=True))
        raise OpArgumentError(f"{op}: the tensor lists differ in length ({counts}); pass one entry per parameter")
    return n


def _refuse_non_tensor(op: str, name: str, lst) -> None:
    i = next(i for i, t in enumerate(lst) if not isinstance(t, torch.Tensor))
    raise OpArgumentError(f"{op}: {name}[{i}] is a {type(lst[i]).__name__}, not a tensor")


def _refuse_other_device(op: str, names, li: int, lst, device: torch.device) -> None:
    i = next(i for i, t in enumerate(lst) if t.device != device)
    raise OpArgumentError(f"{op}: {names[li]}[{i}] is on {lst[i].device} but {names[0]}[0] is on {device}; "
                          "one call takes tensors of one device")


def _refuse_other_shape(op: str, names, li: int, lst, shapes: list) -> None:
    i = next(i for i, t in enumerate(lst) if t.shape != shapes[i])
    raise OpArgumentError(f"{op}: {names[li]}[{i}] has shape {tuple(lst[i].shape)} but {names[0]}[{i}] has "
                          f"{tuple(shapes[i])}; entry i of every list has one shape")


def _refuse_not_dense_floating(op: str, name: str, lst) -> None:
    i = next(i for i, t in enumerate(lst) if not t.dtype.is_floating_point or t.layout != torch.strided)
    raise OpArgumentError(f"{op}: {name}[{i}] is a {lst[i].layout} tensor of dtype {lst[i].dtype}; "
                          "the optimizer ops take dense (strided) floating-point tensors")


def _strided_extents(op: str, name: str, lst, is_written: bool) -> list[int]:
    """Bytes each tensor of a list with non-contiguous ones spans from its ``data_ptr``; a written list's are
    checked for internal overlap first."""
    if is_written:
        _check_internal_overlap(op, name, lst)
    return [_extent_bytes(t) for t in lst]


def _ranges_overlap(starts: list[int], ends: list[int]) -> bool:
    """Whether any two non-empty address ranges ``[start, end)`` overlap.

    Sorted by start, ranges are disjoint exactly when each ends at or before the next one
    starts: one sort and one C-level pass, no per-tensor Python.
    """
    pairs = sorted(zip(starts, ends, strict=True))
    if any(map(operator.eq, starts, ends)):
        pairs = [pr for pr in pairs if pr[1] > pr[0]]  # empty tensors hold no memory
    if len(pairs) < 2:
        return False
    ss = [pr[0] for pr in pairs]
    es = [pr[1] for pr in pairs]
    return any(map(operator.lt, ss[1:], es[:-1]))


def _check_internal_overlap(op: str, name: str, lst) -> None:
    for i, t in enumerate(lst):
        if t.numel() and not t.is_contiguous() and _internally_overlaps(t):
            raise OpArgumentError(f"{op}: {name}[{i}] (shape {tuple(t.shape)}, strides {t.stride()}) has "
                                  "elements sharing one memory location (an expanded or stride-0 view); the op "
                                  "writes it in place: pass a tensor that owns its memory (.clone())")


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element (0 when empty; strides are >= 0)."""
    if t.is_contiguous() or t.numel() == 0:
        return t.nbytes
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def _internally_overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share a memory location (exact)."""
    status = torch._debug_has_internal_overlap(t)  # 0: no, 1: yes, 2: too hard to tell cheaply
    if status != 2:
        return status == 1
    # sufficient for no overlap: by increasing stride, each stride exceeds the span of the smaller ones
    reach = 0  # the largest offset the smaller-stride dimensions reach
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s > 1):
        if stride <= reach:
            break
        reach += (size - 1) * stride
    else:
        return False
    offsets = _element_offsets(t)
    return offsets.unique().numel() != offsets.numel()


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    """The storage offset of every element of ``t`` (host int64, from sizes and strides only)."""
    off = torch.tensor([t.storage_offset()], dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        off = (off[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    return off


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b``, whose address ranges overlap, share an element's memory (exact where cheap)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.element_size() != b.element_size():
        return True  # overlapping ranges that cannot be compared element by element: treat as shared
    if (a.is_contiguous() and b.is_contiguous()) or a.dtype != b.dtype:
        return True
    return bool(torch.isin(_element_offsets(a), _element_offsets(b)).any())


def _check_no_aliasing(op, names, lists, written) -> None:
    """Name the first pair of tensors that share memory where the op writes one of them (exact per pair)."""
    ranges = []
    for li, lst in enumerate(lists):
        for i, t in enumerate(lst):
            if t.numel():
                start = t.data_ptr()
                ranges.append((start, start + _extent_bytes(t), li, i))
    ranges.sort()
    active: list[tuple] = []  # ranges that may still overlap the next one
    for r in ranges:
        active = [a for a in active if a[1] > r[0]]
        for a in active:
            if not (a[2] in written or r[2] in written):
                continue  # two read-only operands may share memory
            x, y = lists[a[2]][a[3]], lists[r[2]][r[3]]
            if x is y or _shares_memory(x, y):
                raise OpArgumentError(
                    f"{op}: {names[a[2]]}[{a[3]}] and {names[r[2]]}[{r[3]}] share memory and the op writes "
                    f"{'both' if a[2] in written and r[2] in written else 'one of them'}; every param and state "
                    "tensor needs memory of its own (e.g. .clone() the aliased one)")
        active.append(r)


# ----------------------------------------------------------------------------- per op
def _check_shared(op: str, lr, beta1, beta2, weight_decay, eps=None) -> None:
    """The hyperparameters the optimizer ops share (``eps``: Adam and LAMB), in the order errors are reported."""
    check_lr(op, lr)
    check_beta(op, beta1, "beta1")
    check_beta(op, beta2, "beta2")
    if eps is not None:
        check_eps(op, eps)
    check_weight_decay(op, weight_decay)


def check_fused_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step) -> None:
    op = "fused_adam"
    _check_shared(op, lr, beta1, beta2, weight_decay, eps)
    device = check_optimizer_tensors(op, ADAM_LISTS, (params, grads, exp_avgs, exp_avg_sqs))
    check_step(op, step, device)


def check_fused_lion(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay) -> None:
    op = "fused_lion"
    _check_shared(op, lr, beta1, beta2, weight_decay)
    check_optimizer_tensors(op, LION_LISTS, (params, grads, exp_avgs))


def check_fused_lamb(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                     max_coeff, min_coeff) -> None:
    op = "fused_lamb"
    _check_shared(op, lr, beta1, beta2, weight_decay, eps)
    check_trust_bounds(op, min_coeff, max_coeff)
    device = check_optimizer_tensors(op, ADAM_LISTS, (params, grads, exp_avgs, exp_avg_sqs))
    check_step(op, step, device)


__all__ = [
    "check_beta", "check_eps", "check_fused_adam", "check_fused_lamb", "check_fused_lion", "check_lr",
    "check_optimizer_tensors", "check_step", "check_trust_bounds", "check_weight_decay",
]
