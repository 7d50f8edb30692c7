"""Emulated Ascend runtime: a CPU-backed ``torch_npu`` and ``torch.npu``.

What it reproduces (from torch_npu's public API and CANN's documented behaviour):

* ``import torch_npu`` installs ``torch.npu``; with CANN missing the import fails with
  ``ImportError: libhccl.so: cannot open shared object file ...`` (fault ``library_missing``)
  and ``torch`` has no ``npu`` attribute.
* ``torch.npu.npurt()`` returns one runtime-API object (the same one every call) with
  ``npuHostRegister(ptr, size, flags) -> int`` and ``npuHostUnregister(ptr) -> int``
  returning ACL codes: 0 on success, ``ACL_ERROR_INVALID_PARAM`` (100000) for a null pointer,
  ``ACL_ERROR_RT_PARAM_INVALID`` (107000) for a bad size/flag/alignment. ``ACL_HOST_REG_MAPPED``
  (0x2) needs a 4096-byte aligned address and length; ``ACL_HOST_REG_PINNED`` (0x10000000)
  does not.
* ``torch.npu.NPUGraph`` / ``torch.npu.graph(g, pool=None, stream=None)``: capture records
  the work, ``replay()`` re-runs it (see :class:`polyaccel.testing.emulation.GraphRecorder`).
* streams, events (asynchronous completion), RNG per device, memory statistics.
* ``torch_npu.npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True)``:
  ``round(input / scales) + zero_points`` (``input * scales`` without div_mode), saturated
  to ``dtype``; scales broadcast along ``axis`` (last dimension only, as documented).
* ``torch_npu.npu_rms_norm``, ``torch_npu.npu_rotary_mul`` and ``torch_npu.npu_swiglu``, autograd-aware, with
  their documented semantics and constraints (:mod:`.emulation_model_ops`).

The plugin offers it through its ``polyaccel_emulated_runtimes`` hook, and
``polyaccel.testing.emulation.emulate("npu", **options)`` installs it; tensors stay on the CPU.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from polyaccel.testing.emulation import EmulatedGraph, ExtensionRuntime, HostMemoryTable, Patcher, RuntimeBinding

from . import emulation_model_ops as model_ops
from .accelerator import NpuAccelerator
from .runtime import (
    ACL_ERROR_INVALID_PARAM,
    ACL_ERROR_RT_PARAM_INVALID,
    ACL_HOST_REG_MAPPED,
    ACL_HOST_REG_PINNED,
    ACL_SUCCESS,
    TORCH_NPU,
)
from .runtime import HOST_REGISTER_ALIGNMENT as PAGE


class _Npurt(RuntimeBinding):
    """``torch.npu.npurt()``: the runtime-API binding (host registration, streams)."""

    def __init__(self, runtime: NpuRuntime):
        invalid = ACL_ERROR_RT_PARAM_INVALID
        super().__init__(runtime, HostMemoryTable(alignment=1, ok=ACL_SUCCESS, invalid_value=invalid,
                                                  already_registered=invalid, not_registered=invalid))

    def npuHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - runtime's name
        rt = self._rt
        code = self._register(int(ptr), int(size), int(flags))
        rt.record("npuHostRegister", ptr, size, flags, result=code)
        return code

    def _register(self, ptr: int, size: int, flags: int) -> int:
        if ptr == 0:
            return ACL_ERROR_INVALID_PARAM
        refused = self._rt.faults.registration_refused
        if refused:
            return int(refused) if not isinstance(refused, bool) else ACL_ERROR_RT_PARAM_INVALID
        if size <= 0 or flags & ~(ACL_HOST_REG_MAPPED | ACL_HOST_REG_PINNED) or not flags:
            return ACL_ERROR_RT_PARAM_INVALID
        if flags & ACL_HOST_REG_MAPPED and (ptr % PAGE or size % PAGE):
            return ACL_ERROR_RT_PARAM_INVALID
        return self._table.register(ptr, size, flags, allowed_flags=(flags,))

    def npuHostUnregister(self, ptr: int) -> int:  # noqa: N802 - runtime's name
        ptr = int(ptr)
        if ptr == 0:
            code = ACL_ERROR_INVALID_PARAM
        elif self._rt.faults.unregister_fails:
            fail = self._rt.faults.unregister_fails
            code = int(fail) if not isinstance(fail, bool) else ACL_ERROR_RT_PARAM_INVALID
        else:
            code = self._table.unregister(ptr)
        self._rt.record("npuHostUnregister", ptr, result=code)
        return code

    def npuStreamCreate(self, ptr: int) -> int:  # noqa: N802
        code = ACL_ERROR_INVALID_PARAM if not ptr else ACL_SUCCESS
        self._rt.record("npuStreamCreate", ptr, result=code)
        return code

    def npuStreamDestroy(self, stream: int) -> int:  # noqa: N802
        code = ACL_ERROR_INVALID_PARAM if not stream else ACL_SUCCESS
        self._rt.record("npuStreamDestroy", stream, result=code)
        return code


class NPUGraph(EmulatedGraph):
    """``torch.npu.NPUGraph``: capture_begin/capture_end/replay/reset/pool."""

    api_name = "NPUGraph"


class NpuRuntime(ExtensionRuntime):
    """The emulated Ascend runtime; ``runtime.npurt`` is the host-registration binding."""

    name, accelerator, vendor, library, graph_class = "npu", NpuAccelerator, TORCH_NPU, "libhccl.so", NPUGraph
    device_name, invalid_device = "Ascend910B (emulated)", "Invalid device id {device}: {count} NPU(s) visible"
    FAULTS = {
        "no_device": "torch_npu imports but no NPU is visible (is_available() False, device_count() 0)",
        "library_missing": "torch_npu is installed but CANN is not: `import torch_npu` raises "
                           "ImportError(libhccl.so ...)",
        "no_npurt": "torch.npu has no npurt() (a torch_npu build without the runtime-API binding)",
        "npurt_init_fails": "torch.npu.npurt() raises RuntimeError (the runtime cannot initialise)",
        "registration_refused": "npuHostRegister returns an ACL error code (True: 107000, or the int given)",
        "unregister_fails": "npuHostUnregister returns an ACL error code (True: 107000, or the int given)",
        "no_graphs": "torch.npu has no NPUGraph/graph (an older torch_npu)",
        "no_fused_adam": "torch's fused Adam has no npu kernel in this torch_npu",
        "no_model_ops": "this torch_npu has none of npu_rms_norm, npu_rotary_mul, npu_swiglu (an older build)",
    }

    def __init__(self, device_count: int = 1, track_allocations: bool = True, **faults: Any):
        super().__init__(device_count, track_allocations, **faults)
        self.npurt = _Npurt(self)

    # ------------------------------------------------------------ modules
    def _build_npu_module(self) -> types.ModuleType:
        rt = self
        m = self.build_device_module()

        def npurt():
            if rt.faults.npurt_init_fails:
                raise RuntimeError("npurt: aclInit failed with error code 100000 (emulated fault)")
            rt.record("npurt")
            return rt.npurt

        m.is_bf16_supported = lambda: True
        if not rt.faults.no_npurt:
            m.npurt = npurt
        return m

    def _install_torch_npu(self, patcher: Patcher, npu_mod: types.ModuleType) -> None:
        rt = self
        m = self.install_extension(patcher, npu_mod)
        patcher.set_module("torch_npu.npu", npu_mod)

        def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):  # noqa: A002 - API name
            rt.record("npu_quantize", tuple(input.shape), dtype, axis, div_mode)
            if axis not in (-1, input.dim() - 1):
                raise RuntimeError(f"npu_quantize: axis only supports the last dimension, got axis={axis}")
            x = input.float()
            y = torch.round(x / scales.float() if div_mode else x * scales.float())
            if zero_points is not None:
                y = y + zero_points.float()
            bounds = {torch.qint8: (-128, 127), torch.quint8: (0, 255), torch.int32: (-(2**31), 2**31 - 1)}
            if dtype not in bounds:
                raise RuntimeError(f"npu_quantize: dtype {dtype} is not one of {list(bounds)}")
            lo, hi = bounds[dtype]
            out = {torch.qint8: torch.int8, torch.quint8: torch.uint8, torch.int32: torch.int32}[dtype]
            return y.clamp(lo, hi).to(out)

        m.npu_quantize = npu_quantize
        if not rt.faults.no_model_ops:
            m.npu_rms_norm = functools.partial(model_ops.npu_rms_norm, rt)
            m.npu_rotary_mul = functools.partial(model_ops.npu_rotary_mul, rt)
            m.npu_swiglu = functools.partial(model_ops.npu_swiglu, rt)

    def install(self, patcher: Patcher) -> None:
        if self.install_missing_library(patcher):
            return
        self._install_torch_npu(patcher, self._build_npu_module())
        if not self.faults.no_fused_adam:
            # torch_npu renames the PrivateUse1 backend to "npu", which puts "npu" among the
            # devices torch's fused optimizers accept; reproduce that answer (not the rename,
            # which torch cannot undo).
            from torch.utils import _foreach_utils

            real = _foreach_utils._get_fused_kernels_supported_devices
            patcher.setattr(_foreach_utils, "_get_fused_kernels_supported_devices", lambda: [*real(), "npu"])

