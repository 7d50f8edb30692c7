"""Ops: one semantics everywhere, the best available builder per device type.

Call ``polyaccel.ops.fused_adam(...)`` and friends; each call resolves (once, then
cached) the builder for the device type of its tensors. ``explain(op)`` tells which
builder was picked and why; ``override(op, builder)`` or ``POLYACCEL_OP_OVERRIDES``
forces one.
"""

from __future__ import annotations

import torch

from .reference.quantize import QuantizedTensor
from .registry import ANY_DEVICE, Candidate, OpBuilder, OpRegistry


def _accelerator_for(device_type: str):
    from ..selection import accelerator_for_device_type

    return accelerator_for_device_type(device_type)


def _populate(reg: OpRegistry) -> None:
    from ..discovery import AVAILABLE, SELECTED, UNAVAILABLE
    from ..selection import plugins
    from . import builtin

    builtin.register_reference_ops(reg)
    ps = plugins()
    # unavailable plugins still contribute: explain() then shows why their builders are not used
    loaded = (AVAILABLE, SELECTED, UNAVAILABLE)
    usable = {rec.name: rec for rec in ps.records.values() if rec.status in loaded}
    for impl in reversed(ps.pm.hook.polyaccel_register_ops.get_hookimpls()):
        rec = usable.get(impl.plugin_name)
        if rec is None:
            continue
        before = {op: len(bs) for op, bs in reg._builders.items()}
        try:
            scoped = _PluginScopedRegistry(reg, rec.name)
            impl.function(*[{"registry": scoped}[a] for a in impl.argnames])
        except Exception as exc:  # noqa: BLE001 - isolate a broken plugin's ops
            # drop what it managed to add, and record the failure
            for op, bs in reg._builders.items():
                n = before.get(op, 0)
                del bs[n:]
            rec.reason = (rec.reason + "; " if rec.reason else "") + (
                f"polyaccel_register_ops raised {type(exc).__name__}: {exc} (its ops are ignored)"
            )


class _PluginScopedRegistry:
    """What a plugin's ``polyaccel_register_ops`` receives: stamps builders with the plugin name."""

    def __init__(self, reg: OpRegistry, plugin: str):
        self._reg = reg
        self.plugin = plugin

    def add(self, builder: OpBuilder) -> OpBuilder:
        if not builder.plugin:
            builder.plugin = self.plugin
        return self._reg.add(builder)

    def register(self, op, name, device_types, loader, **kw) -> OpBuilder:
        kw.setdefault("plugin", self.plugin)
        return self._reg.register(op, name, device_types, loader, **kw)


registry = OpRegistry(_accelerator_for)
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
    if not params:
        return
    registry.resolve("fused_adam", _device_type(params, "fused_adam"))(
        params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, step=step, adam_w_mode=adam_w_mode, bias_correction=bias_correction)


def fused_lion(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay):
    if not params:
        return
    registry.resolve("fused_lion", _device_type(params, "fused_lion"))(
        params, grads, exp_avgs, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)


def fused_lamb(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
               bias_correction=True, max_coeff=10.0, min_coeff=0.01):
    if not params:
        return
    registry.resolve("fused_lamb", _device_type(params, "fused_lamb"))(
        params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, step=step, bias_correction=bias_correction,
        max_coeff=max_coeff, min_coeff=min_coeff)


def quantize(x: torch.Tensor, mode: str = "int8", group_size: int = 128, symmetric: bool = True) -> QuantizedTensor:
    from .reference.quantize import check_quantize_args

    check_quantize_args(x, mode, group_size, symmetric)
    return registry.resolve("quantize", x.device.type)(x, mode=mode, group_size=group_size, symmetric=symmetric)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"dequantize: expected a QuantizedTensor, got {type(qt).__name__}")
    return registry.resolve("dequantize", qt.data.device.type)(qt, dtype=dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return registry.resolve("swiglu", gate.device.type)(gate, up)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return registry.resolve("grouped_mm", x.device.type)(x, weight, offsets)


__all__ = [
    "ANY_DEVICE", "Candidate", "OpBuilder", "OpRegistry", "QuantizedTensor", "dequantize", "explain",
    "fused_adam", "fused_lamb", "fused_lion", "grouped_mm", "override", "quantize", "registry",
    "resolve", "swiglu",
]
