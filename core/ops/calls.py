"""The op entry points: check a call against its op's contract, then hand it to the builder.

Each call looks the process's op registry up through the runtime when it is made (nothing is
built at import) and resolves the builder for its tensors' device type: once, then the
registry's cache returns the loaded callable. ``explain(op)`` tells which builder was picked
and why; ``override(op, builder)`` or ``POLYACCEL_OP_OVERRIDES`` forces one.
"""

from __future__ import annotations

import torch

from ..runtime import current
from . import contract, contract_muon, contract_muon_passes
from .reference import muon as _muon
from .reference.moe_experts import check_moe_down_combine_shapes, check_moe_gate_up_shapes
from .reference.quantize import QuantizedTensor, check_dequantize_args, check_quantize_args

#: the process's runtime (made when polyaccel.runtime is imported); its op registry is read per call
_RUNTIME = current()


def explain(op: str, device_type: str | None = None) -> str:
    return _RUNTIME.ops.explain(op, device_type)


def override(op: str, builder_name: str | None) -> None:
    _RUNTIME.ops.override(op, builder_name)


def resolve(op: str, device_type: str):
    return _RUNTIME.ops.resolve(op, device_type)


def _device_type(tensors, op: str) -> str:
    for t in tensors:
        return t.device.type
    raise ValueError(f"{op}: no tensors given")


def fused_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
               adam_w_mode=True, bias_correction=True):
    """``fused_adam`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.fused_adam` (docs/plugin-authoring.md).
    """
    contract.check_fused_adam(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=weight_decay, step=step)
    if not params:
        return
    _RUNTIME.ops.resolve("fused_adam", _device_type(params, "fused_adam"))(
        params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, step=step, adam_w_mode=adam_w_mode, bias_correction=bias_correction)


def fused_lion(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay):
    """``fused_lion`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.fused_lion` (docs/plugin-authoring.md).
    """
    contract.check_fused_lion(params, grads, exp_avgs, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    if not params:
        return
    _RUNTIME.ops.resolve("fused_lion", _device_type(params, "fused_lion"))(
        params, grads, exp_avgs, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)


def fused_lamb(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
               bias_correction=True, max_coeff=10.0, min_coeff=0.01):
    """``fused_lamb`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.fused_lamb` (docs/plugin-authoring.md).
    """
    contract.check_fused_lamb(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=weight_decay, step=step, max_coeff=max_coeff, min_coeff=min_coeff)
    if not params:
        return
    _RUNTIME.ops.resolve("fused_lamb", _device_type(params, "fused_lamb"))(
        params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, step=step, bias_correction=bias_correction,
        max_coeff=max_coeff, min_coeff=min_coeff)


def quantize(x: torch.Tensor, mode: str = "int8", group_size: int = 128, symmetric: bool = True) -> QuantizedTensor:
    """``quantize`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.quantize` (docs/plugin-authoring.md).
    """
    check_quantize_args(x, mode, group_size, symmetric)
    return _RUNTIME.ops.resolve("quantize", x.device.type)(x, mode=mode, group_size=group_size, symmetric=symmetric)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dequantize`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.dequantize` (docs/plugin-authoring.md).
    """
    check_dequantize_args(qt)
    return _RUNTIME.ops.resolve("dequantize", qt.data.device.type)(qt, dtype=dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``swiglu`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.swiglu` (docs/plugin-authoring.md).
    """
    return _RUNTIME.ops.resolve("swiglu", gate.device.type)(gate, up)


def weighted_swiglu(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weighted_swiglu`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.weighted_swiglu` (docs/plugin-authoring.md).
    """
    return _RUNTIME.ops.resolve("weighted_swiglu", gate.device.type)(gate, up, weights)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``grouped_mm`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.grouped_mm` (docs/plugin-authoring.md).
    """
    return _RUNTIME.ops.resolve("grouped_mm", x.device.type)(x, weight, offsets)


def gather_sum(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``gather_sum`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.gather_sum` (docs/plugin-authoring.md).
    """
    return _RUNTIME.ops.resolve("gather_sum", rows.device.type)(rows, index, weights)


def moe_gate_up(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``moe_gate_up`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.moe_gate_up` (docs/plugin-authoring.md).
    """
    check_moe_gate_up_shapes(x, index, weight, offsets)
    return _RUNTIME.ops.resolve("moe_gate_up", x.device.type)(x, index, weight, offsets)


def moe_down_combine(h: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor,
                     weights: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_down_combine`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.moe_down_combine` (docs/plugin-authoring.md).
    """
    check_moe_down_combine_shapes(h, weight, offsets, index, weights)
    return _RUNTIME.ops.resolve("moe_down_combine", h.device.type)(h, weight, offsets, index, weights)


def newton_schulz(x: torch.Tensor, *, steps: int = _muon.NS_STEPS, coefficients=_muon.NS_COEFFICIENTS,
                  eps: float = _muon.NS_EPS, out: torch.Tensor | None = None) -> torch.Tensor:
    """``newton_schulz`` through the best builder for the tensor's device type.

    Semantics and signature: :func:`polyaccel.ops.reference.newton_schulz` (docs/plugin-authoring.md).
    """
    contract_muon.check_newton_schulz(x, steps=steps, coefficients=coefficients, eps=eps, out=out)
    fn = _RUNTIME.ops.resolve("newton_schulz", x.device.type)
    if out is None:  # (a builder written before ``out`` existed still serves the calls without it)
        return fn(x, steps=steps, coefficients=tuple(coefficients), eps=eps)
    return fn(x, steps=steps, coefficients=tuple(coefficients), eps=eps, out=out)


def fused_muon(params, grads, momentum_buffers, *, lr, momentum, weight_decay, nesterov=True,
               ns_steps=_muon.NS_STEPS, ns_coefficients=_muon.NS_COEFFICIENTS, eps=_muon.NS_EPS,
               ns_dtype=torch.bfloat16, lr_adjustment="original", head_splits=None):
    """``fused_muon`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.fused_muon` (docs/plugin-authoring.md, docs/zero-muon.md).
    """
    contract_muon.check_fused_muon(params, grads, momentum_buffers, lr=lr, momentum=momentum,
                                   weight_decay=weight_decay, nesterov=nesterov, ns_steps=ns_steps,
                                   ns_coefficients=ns_coefficients, eps=eps, ns_dtype=ns_dtype,
                                   lr_adjustment=lr_adjustment, head_splits=head_splits)
    if not params:
        return
    _RUNTIME.ops.resolve("fused_muon", _device_type(params, "fused_muon"))(
        params, grads, momentum_buffers, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
        ns_steps=ns_steps, ns_coefficients=tuple(ns_coefficients), eps=eps, ns_dtype=ns_dtype,
        lr_adjustment=lr_adjustment, head_splits=None if head_splits is None else list(head_splits))


def muon_momentum(grad, momentum_buffer, out, *, grad_offsets, buffer_offsets, out_offsets, lengths, momentum,
                  nesterov=True):
    """``muon_momentum`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.muon_momentum` (docs/plugin-authoring.md).
    """
    contract_muon_passes.check_muon_momentum(grad, momentum_buffer, out, grad_offsets=grad_offsets,
                                             buffer_offsets=buffer_offsets, out_offsets=out_offsets, lengths=lengths,
                                             momentum=momentum, nesterov=nesterov)
    if not lengths:
        return
    _RUNTIME.ops.resolve("muon_momentum", grad.device.type)(
        grad, momentum_buffer, out, grad_offsets=list(grad_offsets), buffer_offsets=list(buffer_offsets),
        out_offsets=list(out_offsets), lengths=list(lengths), momentum=momentum, nesterov=nesterov)


def muon_apply(params, updates, *, param_offsets, update_offsets, lengths, lr, weight_decays, lr_scales):
    """``muon_apply`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.muon_apply` (docs/plugin-authoring.md).
    """
    contract_muon_passes.check_muon_apply(params, updates, param_offsets=param_offsets, update_offsets=update_offsets,
                                          lengths=lengths, lr=lr, weight_decays=weight_decays, lr_scales=lr_scales)
    if not lengths:
        return
    _RUNTIME.ops.resolve("muon_apply", params.device.type)(
        params, updates, param_offsets=list(param_offsets), update_offsets=list(update_offsets), lengths=list(lengths),
        lr=lr, weight_decays=list(weight_decays), lr_scales=list(lr_scales))


def provides(op: str, device_type: str) -> bool:
    """Whether a builder other than the reference serves ``op`` on ``device_type`` (a plugin's or a vendor's).

    For callers with a composed path of their own that is faster than an op's reference (AutoEP's
    experts: the unfused ops, each through its own best builder).
    """
    return _RUNTIME.ops.chosen(op, device_type).kind != "reference"
