"""Ops: one semantics everywhere, the best available builder per device type.

Call ``polyaccel.ops.fused_adam(...)`` and friends; each call resolves (once, then
cached) the builder for the device type of its tensors. ``explain(op)`` tells which
builder was picked and why; ``override(op, builder)`` or ``POLYACCEL_OP_OVERRIDES``
forces one.
"""

from __future__ import annotations

import torch

from ..errors import OpError
from ..selection import _lock as _selection_lock
from .reference.quantize import QuantizedTensor
from .registry import ANY_DEVICE, Candidate, OpBuilder, OpRegistry


def _accelerator_for(device_type: str):
    from ..selection import accelerator_for_device_type

    return accelerator_for_device_type(device_type)


def _populate(reg: OpRegistry) -> None:
    """The core's reference builders, then every loaded plugin's, in discovery order.

    A plugin's ``polyaccel_register_ops`` is all or nothing: its builders enter the registry
    only when the hook returns. If it raises, what it added is dropped, the registry keeps
    the failure (``explain`` shows it) and the plugin is isolated (``polyaccel report``).
    """
    from .. import discovery
    from ..selection import plugins
    from . import builtin

    builtin.register_reference_ops(reg)
    ps = plugins()
    impls = {impl.plugin_name: impl for impl in ps.pm.hook.polyaccel_register_ops.get_hookimpls()}
    for rec in list(ps.records.values()):
        impl = impls.get(rec.name)
        # unavailable plugins still contribute: explain() then shows why their builders are not used
        if impl is None or rec.status not in discovery.LOADED_STATUSES:
            continue
        scoped = _PluginScopedRegistry(reg, rec.name)
        try:
            impl.function(*[{"registry": scoped}[a] for a in impl.argnames])
            added = scoped.commit()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - isolate a broken plugin's ops
            error = f"polyaccel_register_ops raised {type(exc).__name__}: {exc}"
            reg.discard(scoped.pending)
            reg.record_plugin_failure(rec.name, error, [(b.op, b.name) for b in scoped.pending])
            discovery.isolate(ps, rec, error)
            continue
        if rec.status == discovery.LOADED:
            listed = ", ".join(f"{b.name} ({b.op})" for b in added)
            rec.reason = ("provides no accelerator (nothing to select); "
                          + (f"op builders: {listed}" if listed else "its hooks are in use"))


class _PluginScopedRegistry:
    """What a plugin's ``polyaccel_register_ops`` receives.

    Stamps builders with the plugin name and holds them until the hook returns
    (:meth:`commit`), so a hook that raises half way leaves nothing behind.
    """

    def __init__(self, reg: OpRegistry, plugin: str):
        self._reg = reg
        self.plugin = plugin
        self.pending: list[OpBuilder] = []

    def add(self, builder: OpBuilder) -> OpBuilder:
        if not isinstance(builder, OpBuilder):
            raise TypeError(f"registry.add() takes a polyaccel.ops.OpBuilder, got {type(builder).__name__}")
        if not builder.plugin:
            builder.plugin = self.plugin
        taken = [b for b in self._reg._builders.get(builder.op, []) + self.pending
                 if b.op == builder.op and b.name == builder.name]
        if taken:
            owner = taken[0].plugin or "?"
            raise OpError(f"op {builder.op!r} already has a builder named {builder.name!r} "
                          f"(from plugin {owner!r}); builder names are unique per op")
        self.pending.append(builder)
        return builder

    def register(self, op, name, device_types, loader, **kw) -> OpBuilder:
        """Shorthand for ``add(OpBuilder(op, name, device_types, loader, **kw))``."""
        kw.setdefault("plugin", self.plugin)
        return self.add(OpBuilder(op=op, name=name, device_types=tuple(device_types), loader=loader, **kw))

    def commit(self) -> list[OpBuilder]:
        for b in self.pending:
            self._reg.add(b)
        return list(self.pending)


# one lock with selection: discovery registers the ops, and op resolution may run discovery
registry = OpRegistry(_accelerator_for, lock=_selection_lock)
registry.set_populator(_populate)


def explain(op: str, device_type: str | None = None) -> str:
    return registry.explain(op, device_type)


def override(op: str, builder_name: str | None) -> None:
    registry.override(op, builder_name)


def resolve(op: str, device_type: str):
    return registry.resolve(op, device_type)


def _device_type(tensors, op: str) -> str:
    for t in tensors:
        return t.device.type
    raise ValueError(f"{op}: no tensors given")


def fused_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
               adam_w_mode=True, bias_correction=True):
    """``fused_adam`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.fused_adam` (docs/plugin-authoring.md).
    """
    if not params:
        return
    registry.resolve("fused_adam", _device_type(params, "fused_adam"))(
        params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, step=step, adam_w_mode=adam_w_mode, bias_correction=bias_correction)


def fused_lion(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay):
    """``fused_lion`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.fused_lion` (docs/plugin-authoring.md).
    """
    if not params:
        return
    registry.resolve("fused_lion", _device_type(params, "fused_lion"))(
        params, grads, exp_avgs, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)


def fused_lamb(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
               bias_correction=True, max_coeff=10.0, min_coeff=0.01):
    """``fused_lamb`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.fused_lamb` (docs/plugin-authoring.md).
    """
    if not params:
        return
    registry.resolve("fused_lamb", _device_type(params, "fused_lamb"))(
        params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, step=step, bias_correction=bias_correction,
        max_coeff=max_coeff, min_coeff=min_coeff)


def quantize(x: torch.Tensor, mode: str = "int8", group_size: int = 128, symmetric: bool = True) -> QuantizedTensor:
    """``quantize`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.quantize` (docs/plugin-authoring.md).
    """
    from .reference.quantize import check_quantize_args

    check_quantize_args(x, mode, group_size, symmetric)
    return registry.resolve("quantize", x.device.type)(x, mode=mode, group_size=group_size, symmetric=symmetric)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dequantize`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.dequantize` (docs/plugin-authoring.md).
    """
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"dequantize: expected a QuantizedTensor, got {type(qt).__name__}")
    return registry.resolve("dequantize", qt.data.device.type)(qt, dtype=dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``swiglu`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.swiglu` (docs/plugin-authoring.md).
    """
    return registry.resolve("swiglu", gate.device.type)(gate, up)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``grouped_mm`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.grouped_mm` (docs/plugin-authoring.md).
    """
    return registry.resolve("grouped_mm", x.device.type)(x, weight, offsets)


__all__ = [
    "ANY_DEVICE", "Candidate", "OpBuilder", "OpRegistry", "QuantizedTensor", "dequantize", "explain",
    "fused_adam", "fused_lamb", "fused_lion", "grouped_mm", "override", "quantize", "registry",
    "resolve", "swiglu",
]
