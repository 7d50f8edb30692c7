"""Emulated Biren runtime: a CPU-backed ``torch_supa`` (+ ``torch.supa``) and ``torch_supa_ext``.

What it reproduces (from torch_supa's public API and what DeepSpeed's supa backend relies on):

* ``import torch_supa`` installs ``torch.supa`` and, like the real extension, presents parts of
  itself as ``torch.cuda``: while active, ``torch.cuda.is_available()`` is True and
  ``torch.cuda.device_count()`` is the SUPA device count (option ``cuda_face``). A CUDA plugin
  that trusts ``torch.cuda`` alone would claim this machine.
* ``torch.supa.supart()`` is the runtime-API binding with ``supaHostRegister(ptr, size, flags)``
  and ``supaHostUnregister(ptr)`` returning runtime error codes (CUDA-compatible numbering:
  0 success, 1 invalid value, 712 already registered, 713 not registered);
  ``torch.supa.check_error(code)`` raises on a non-zero code.
* ``torch.supa.SUPAGraph`` / ``torch.supa.graph(g, pool=None, stream=None)``: capture records the
  work and ``replay()`` re-runs it.
* ``torch_supa_ext.deepspeed`` registers ``torch.ops.deepspeed.multi_tensor_adam``,
  ``multi_tensor_lion`` and ``lamb`` with DeepSpeed's argument order and math (fault
  ``ext_missing`` leaves them out). Like the real kernels they walk each tensor as ``numel()``
  consecutive elements from its data pointer, ignoring strides.
* streams, events with asynchronous completion, RNG per device, memory statistics.

Tensors stay on the CPU. Offered through the plugin's ``polyaccel_emulated_runtimes`` hook:
``polyaccel.testing.emulation.emulate("supa", **options)`` installs it.
"""

from __future__ import annotations

import importlib.machinery
import math
import types
from typing import Any

import torch
from polyaccel.testing.emulation import (
    EmulatedGraph,
    ExtensionRuntime,
    HostMemoryTable,
    Patcher,
    RuntimeBinding,
    mark_emulated,
)

from .accelerator import SupaAccelerator
from .runtime import TORCH_SUPA

SUPA_SUCCESS = 0
SUPA_ERROR_INVALID_VALUE = 1
SUPA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
SUPA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
SUPA_HOST_REGISTER_DEFAULT = 0x0
SUPA_HOST_REGISTER_PORTABLE = 0x1
SUPA_HOST_REGISTER_MAPPED = 0x2


class _Supart(RuntimeBinding):
    """``torch.supa.supart()``: the runtime-API binding."""

    def __init__(self, runtime: SupaRuntime):
        super().__init__(runtime, HostMemoryTable(
            alignment=1, ok=SUPA_SUCCESS, invalid_value=SUPA_ERROR_INVALID_VALUE,
            already_registered=SUPA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
            not_registered=SUPA_ERROR_HOST_MEMORY_NOT_REGISTERED))

    def supaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - runtime's name
        refused = self._rt.faults.registration_refused
        if refused:
            code = int(refused) if not isinstance(refused, bool) else SUPA_ERROR_INVALID_VALUE
        else:
            code = self._table.register(int(ptr), int(size), int(flags), allowed_flags=(0, 1, 2, 3))
        self._rt.record("supaHostRegister", ptr, size, flags, result=code)
        return code

    def supaHostUnregister(self, ptr: int) -> int:  # noqa: N802 - runtime's name
        fail = self._rt.faults.unregister_fails
        if fail:
            code = int(fail) if not isinstance(fail, bool) else SUPA_ERROR_HOST_MEMORY_NOT_REGISTERED
        else:
            code = self._table.unregister(int(ptr))
        self._rt.record("supaHostUnregister", ptr, result=code)
        return code

    def supaGetErrorString(self, code: int) -> str:  # noqa: N802
        return {
            SUPA_SUCCESS: "no error",
            SUPA_ERROR_INVALID_VALUE: "invalid argument",
            SUPA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
            SUPA_ERROR_HOST_MEMORY_NOT_REGISTERED: "pointer does not correspond to a registered memory region",
        }.get(int(code), f"unknown error {code}")


class SUPAGraph(EmulatedGraph):
    """``torch.supa.SUPAGraph``."""

    api_name = "SUPAGraph"


# -------------------------------------------------- torch_supa_ext.deepspeed kernels (DeepSpeed's math)
def _flat(t: torch.Tensor) -> torch.Tensor:
    """What the real kernels see of ``t``: ``numel()`` consecutive elements from ``data_ptr()``, strides ignored."""
    return t.reshape(-1) if t.is_contiguous() else t.as_strided((t.numel(),), (1,))


def _ds_multi_tensor_adam(rt, chunk_size, noop_flag, grads, params, exp_avgs, exp_avg_sqs, lr, beta1, beta2,
                          eps, step, mode, bias_correction, weight_decay):
    rt.record("deepspeed.multi_tensor_adam", len(params), step=step, mode=mode, bias_correction=bias_correction)
    if int(noop_flag.item()) == 1:
        return
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    for g, p, m, v in zip(grads, params, exp_avgs, exp_avg_sqs, strict=True):
        g, p, m, v = _flat(g), _flat(p), _flat(m), _flat(v)
        g32, p32, m32, v32 = g.float(), p.float(), m.float(), v.float()
        if mode == 0 and weight_decay:
            g32 = g32 + weight_decay * p32
        m32 = beta1 * m32 + (1 - beta1) * g32
        v32 = beta2 * v32 + (1 - beta2) * g32 * g32
        denom = v32.sqrt() / math.sqrt(bc2) + eps
        if mode == 1 and weight_decay:
            p32 = p32 * (1 - lr * weight_decay)
        p.copy_(p32 - (lr / bc1) * m32 / denom)
        m.copy_(m32)
        v.copy_(v32)


def _ds_multi_tensor_lion(rt, chunk_size, noop_flag, grads, params, exp_avgs, lr, beta1, beta2, step,
                          weight_decay):
    rt.record("deepspeed.multi_tensor_lion", len(params))
    if int(noop_flag.item()) == 1:
        return
    for g, p, m in zip(grads, params, exp_avgs, strict=True):
        g, p, m = _flat(g), _flat(p), _flat(m)
        g32, p32, m32 = g.float(), p.float(), m.float()
        update = torch.sign(beta1 * m32 + (1 - beta1) * g32)
        p.copy_(p32 - lr * (update + weight_decay * p32))
        m.copy_(beta2 * m32 + (1 - beta2) * g32)


def _ds_lamb(rt, p, p_copy, exp_avg, exp_avg_sq, grad, lr, beta1, beta2, max_coeff, min_coeff, eps,
             combined_scale, step, eps_mode, bias_correction, weight_decay):
    """DeepSpeed's LAMB: step size lr*sqrt(bc2)/bc1, eps added to sqrt(v) (eps_mode 1) or inside it (0)."""
    rt.record("deepspeed.lamb", step=step, eps_mode=eps_mode, bias_correction=bias_correction)
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step) if bias_correction else lr
    p, exp_avg, exp_avg_sq, grad = _flat(p), _flat(exp_avg), _flat(exp_avg_sq), _flat(grad)
    g = grad.float() / combined_scale
    m = beta1 * exp_avg.float() + (1 - beta1) * g
    v = beta2 * exp_avg_sq.float() + (1 - beta2) * g * g
    denom = (v + eps).sqrt() if eps_mode == 0 else v.sqrt() + eps
    update = m / denom + weight_decay * p.float()
    p_norm, u_norm = p.float().norm(), update.norm()
    coeff = (p_norm / u_norm).clamp(min_coeff, max_coeff) if p_norm > 0 and u_norm > 0 else torch.tensor(1.0)
    p.copy_(p.float() - step_size * coeff * update)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if p_copy.numel():
        _flat(p_copy).copy_(p)
    return coeff


class SupaRuntime(ExtensionRuntime):
    name, accelerator, vendor, library, graph_class = "supa", SupaAccelerator, TORCH_SUPA, "libsupa.so", SUPAGraph
    device_name, invalid_device = "Biren BR166 (emulated)", "supa error: invalid device ordinal {device}"
    FAULTS = {
        "library_missing": "torch_supa is installed but the Biren driver/runtime libraries are not: "
                           "`import torch_supa` raises ImportError(libsupa.so ...)",
        "no_device": "torch_supa imports but no SUPA device is visible",
        "no_supart": "torch.supa has no supart() binding (host registration unavailable)",
        "registration_refused": "supaHostRegister returns an error code (True: 1, or the int given)",
        "unregister_fails": "supaHostUnregister returns an error code (True: 713, or the int given)",
        "no_graphs": "torch.supa has no SUPAGraph/graph",
        "ext_missing": "torch_supa_ext is not installed: torch.ops.deepspeed.* kernels are not registered",
    }

    def __init__(self, device_count: int = 1, cuda_face: bool = True, track_allocations: bool = True,
                 **faults: Any):
        super().__init__(device_count, track_allocations, **faults)
        self.cuda_face = cuda_face
        self.supart = _Supart(self)

    def _build_supa_module(self) -> types.ModuleType:
        rt = self
        m = self.build_device_module()

        def supart():
            rt.record("supart")
            return rt.supart

        def check_error(code: int) -> None:
            if int(code) != SUPA_SUCCESS:
                raise RuntimeError(f"SUPA error: {rt.supart.supaGetErrorString(code)} (code {int(code)})")

        def _lazy_call(callback) -> None:
            callback()

        for fn in (check_error, _lazy_call):
            setattr(m, fn.__name__, fn)
        if not rt.faults.no_supart:
            m.supart = supart
        return m

    def _deepspeed_ops(self) -> types.SimpleNamespace:
        rt = self
        ns = types.SimpleNamespace(
            multi_tensor_adam=lambda *a: _ds_multi_tensor_adam(rt, *a),
            multi_tensor_lion=lambda *a: _ds_multi_tensor_lion(rt, *a),
            lamb=lambda *a: _ds_lamb(rt, *a),
        )
        return mark_emulated(ns)

    def install(self, patcher: Patcher) -> None:
        if self.install_missing_library(patcher):
            patcher.fail_import("torch_supa_ext", ModuleNotFoundError("No module named 'torch_supa_ext'"))
            return
        self.install_extension(patcher, self._build_supa_module())
        if self.cuda_face:
            # torch_supa answers torch.cuda's availability questions for its own devices
            patcher.setattr(torch.cuda, "is_available", lambda: self.device_count > 0)
            patcher.setattr(torch.cuda, "device_count", lambda: self.device_count)
        if self.faults.ext_missing:
            patcher.fail_import("torch_supa_ext", ModuleNotFoundError("No module named 'torch_supa_ext'"))
            patcher.setattr(torch.ops, "deepspeed", types.SimpleNamespace())
            return
        # nothing is registered until `import torch_supa_ext.deepspeed`, whose import registers the
        # kernels under torch.ops.deepspeed (as the real extension does)
        patcher.setattr(torch.ops, "deepspeed", types.SimpleNamespace())
        ext = mark_emulated(types.ModuleType("torch_supa_ext"))
        ext.__spec__ = importlib.machinery.ModuleSpec("torch_supa_ext", None, is_package=True)
        ext.__path__ = []
        patcher.set_module("torch_supa_ext", ext)

        def register_kernels(module: types.ModuleType) -> None:
            self.record("import torch_supa_ext.deepspeed")
            patcher.setattr(torch.ops, "deepspeed", self._deepspeed_ops())
            patcher.setattr(ext, "deepspeed", module)

        patcher.lazy_module("torch_supa_ext.deepspeed", register_kernels)

