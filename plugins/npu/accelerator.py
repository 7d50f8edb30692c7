"""Ascend NPUs through torch_npu: hccl, NPUGraph, npuHostRegister (MAPPED, 4096-aligned)."""

from __future__ import annotations

import threading

import torch
from polyaccel.errors import Unsupported
from polyaccel.vendor_extension import ExtensionAccelerator

from . import runtime


class NpuAccelerator(ExtensionAccelerator):
    name = "npu"
    device_type = "npu"
    priority = 100
    communication_backend = "hccl"
    #: HCCL binds a communicator to the current device, like NCCL
    comm_binds_device = True
    return_code_name = "ACL error"
    graph_class = "NPUGraph"
    vendor = runtime.TORCH_NPU
    #: what torch.npu provides wherever torch_npu imports
    device_claims = ("streams", "events", "rng", "memory_stats", "pinned", "fp16", "bf16")

    def __init__(self) -> None:
        super().__init__()
        self._npurt_lock = threading.Lock()
        self._npurt: tuple[object | None, str] | None = None

    # ---------------------------------------------------------------- capabilities
    def host_register_offered(self) -> bool:
        return self._host_register_binding()[0] is not None

    def report_facts(self) -> dict | None:
        mod, reason = runtime.TORCH_NPU.load()
        if mod is None:
            if runtime.TORCH_NPU.is_not_installed(reason):
                return None  # nothing to say beyond the plugin's status line
            return {"runtime": reason, "hint": runtime.AUTOLOAD_HINT}
        facts = runtime.TORCH_NPU.facts(mod)
        binding, why = runtime.npurt_binding()
        facts["host_register"] = "npuHostRegister (ACL_HOST_REG_MAPPED, 4096-byte aligned)" if binding else why
        has_graphs = hasattr(runtime.TORCH_NPU.device_module(), "NPUGraph")
        facts["graphs"] = "torch.npu.NPUGraph" if has_graphs else "not in this torch_npu"
        return facts

    def _device_module(self, required: bool = True):
        npu = runtime.TORCH_NPU.device_module()
        if npu is None and required:
            raise Unsupported(self.name, "torch.npu", "import torch_npu on an Ascend host with CANN")
        return npu

    # --------------------------------------------------------- host memory
    def pin_memory_alignment(self) -> int:
        return runtime.HOST_REGISTER_ALIGNMENT

    def _host_register_binding(self) -> tuple[object | None, str]:
        with self._npurt_lock:
            if self._npurt is None or self._npurt[0] is None:
                self._npurt = runtime.npurt_binding()
            return self._npurt

    def host_register_unavailable_reason(self) -> str:
        """Why register_host_memory is unsupported here ("" when it is supported)."""
        return self._host_register_binding()[1]

    def register_host_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        binding, reason = self._host_register_binding()
        if binding is None:
            raise Unsupported(self.name, "host_register", reason)
        return super().register_host_memory(tensor)

    def _host_register(self, ptr: int, nbytes: int) -> None:
        binding, reason = self._host_register_binding()
        if binding is None:
            raise Unsupported(self.name, "host_register", reason)
        rc = int(binding.npuHostRegister(ptr, nbytes, runtime.ACL_HOST_REG_MAPPED))
        if rc != 0:
            raise self.runtime_call_error(
                f"npuHostRegister({ptr:#x}, {nbytes}, ACL_HOST_REG_MAPPED)", rc,
                hint=f"the buffer was not registered (range must be {runtime.HOST_REGISTER_ALIGNMENT}-byte aligned "
                     "and not overlap a registered range)")

    def _host_unregister(self, ptr: int) -> None:
        binding, reason = self._host_register_binding()
        if binding is None:
            raise Unsupported(self.name, "host_register", reason)
        rc = int(binding.npuHostUnregister(ptr))
        if rc != 0:
            raise self.runtime_call_error(f"npuHostUnregister({ptr:#x})", rc, unregistering=True)
