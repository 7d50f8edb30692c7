"""Stage 3's hold on autograd: what forward saves, and the re-gather before each module's backward.

While a module's forward runs, a tensor autograd saves that is (a view of) a gathered parameter is
kept as a reference to the parameter (:class:`SavedParam`), so releasing the parameter after forward
really frees the gathered storage. A module's outputs are wrapped in :class:`PreBackward`, whose
backward gathers the module's parameters again before the module's own backward runs.
"""

from __future__ import annotations

import functools

import torch


class SavedParam:
    """What autograd keeps, during forward, in place of a saved tensor that is (a view of) a gathered
    parameter: the parameter and the view's geometry. Keeping the tensor would keep the gathered storage
    alive after the module's forward has released it (``linear`` saves ``weight.t()``, a view), so every
    layer's gathered weights would stay until its backward. Unpacked in backward, after the module's
    parameters were gathered again, as the same view of the new storage."""

    __slots__ = ("info", "size", "stride", "offset")

    def __init__(self, info, t: torch.Tensor):
        self.info = info
        self.size, self.stride = t.size(), t.stride()
        self.offset = t.storage_offset() - info.param.storage_offset()

    def load(self) -> torch.Tensor:
        p = self.info.param
        if p.numel() != self.info.numel:
            raise RuntimeError(
                f"ZeRO stage 3: backward needs parameter {self.info.name!r}, which is not gathered now; a "
                "tensor saved in forward refers to it outside the backward of the module that owns it. "
                "Mark the module that uses it as a leaf (zero_optimization.stage3_leaf_modules) so it is "
                "gathered with its user.")
        return p.detach().as_strided(self.size, self.stride, p.storage_offset() + self.offset)


def unpack_saved(x):
    """The unpack hook that goes with :func:`pack_saved`."""
    return x.load() if isinstance(x, SavedParam) else x


class PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner, module, *outputs):
        ctx.owner, ctx.module = owner, module
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner._fetch(ctx.module, backward=True)
        return (None, None) + grads


# Module-level and recursive by name, not nested closures: a closure that calls itself is a reference cycle,
# which would keep every module output it saw (the logits among them) alive until the next garbage collection.
def tensors_needing_grad(x, found: list) -> list:
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            found.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            tensors_needing_grad(y, found)
    elif isinstance(x, dict):
        for y in x.values():
            tensors_needing_grad(y, found)
    return found


def replace_tensors(x, wrapped: dict):
    """``x`` with each tensor whose id is in ``wrapped`` replaced by its wrapped version (dicts in place)."""
    if isinstance(x, torch.Tensor):
        return wrapped.get(id(x), x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(replace_tensors(y, wrapped) for y in x))
    if isinstance(x, (list, tuple)):
        return type(x)(replace_tensors(y, wrapped) for y in x)
    if isinstance(x, dict):
        for k in list(x.keys()):
            x[k] = replace_tensors(x[k], wrapped)
        return x
    return x


def pack_saved(in_forward: dict, t: torch.Tensor) -> SavedParam | torch.Tensor:
    """The saved-tensor pack hook: a reference in place of ``t`` when ``t`` is (a view of) one of the
    parameters ``in_forward`` (gathered for a running forward); ``t`` itself otherwise."""
    if not in_forward or not t.numel() or t.layout is not torch.strided or t.is_nested:
        return t  # (a parameter is a plain strided tensor; sparse and nested ones have no single storage)
    ptr = t.untyped_storage().data_ptr()
    off = t.storage_offset()
    for info in in_forward.values():  # (parameters of one gather may share a storage: match the range)
        p = info.param
        if (p.numel() and p.dtype == t.dtype and p.untyped_storage().data_ptr() == ptr
                and p.storage_offset() <= off < p.storage_offset() + p.numel()):
            return SavedParam(info, t)
    return t


def wrap_outputs(owner, module, output):
    """``output`` with every tensor that needs a gradient passed through :class:`PreBackward`, so that
    ``owner._fetch(module, backward=True)`` runs before the module's backward."""
    if isinstance(output, torch.Tensor):  # (most modules: no structure to walk and rebuild)
        return PreBackward.apply(owner, module, output)[0] if output.requires_grad else output
    tensors = tensors_needing_grad(output, [])
    if not tensors:
        return output
    wrapped = dict(zip(map(id, tensors), PreBackward.apply(owner, module, *tensors), strict=True))
    return replace_tensors(output, wrapped)


def pack_saved_any(packers, t: torch.Tensor):
    """Saved-tensor pack hook over several stage-3 groups: a parameter reference where one recognises
    ``t``."""
    for pack in packers:
        ref = pack(t)
        if ref is not t:
            return ref
    return t


def saved_tensor_hooks(partitioners: list) -> tuple | None:
    """The ``(pack, unpack)`` saved-tensor hooks for the stage-3 ones among ``partitioners``, or None without
    one. Called for every tensor autograd saves in forward: one partitioner's hook is installed as it is."""
    packers = [p.pack_saved for p in partitioners if hasattr(p, "pack_saved")]
    if not packers:
        return None
    pack = packers[0] if len(packers) == 1 else functools.partial(pack_saved_any, packers)
    return pack, unpack_saved
