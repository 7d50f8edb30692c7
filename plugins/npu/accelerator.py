"""Ascend NPUs through torch_npu: hccl, NPUGraph, npuHostRegister (MAPPED, 4096-aligned)."""

from __future__ import annotations

import threading

import torch
from polyaccel.accelerator import Accelerator, ProbeResult
from polyaccel.errors import PolyaccelError, Unsupported

from . import runtime


class NpuAccelerator(Accelerator):
    name = "npu"
    device_type = "npu"
    priority = 100
    communication_backend = "hccl"

    def __init__(self) -> None:
        super().__init__()
        self._npurt_lock = threading.Lock()
        self._npurt: tuple[object | None, str] | None = None

    # ---------------------------------------------------------------- identity
    def probe(self) -> ProbeResult:
        mod, reason = runtime.import_torch_npu()
        if mod is None:
            return ProbeResult(False, reason, details={"hint": runtime.AUTOLOAD_HINT})
        npu = runtime.npu_module()
        details = {"torch_npu": getattr(mod, "__version__", "unknown")}
        try:
            available = bool(npu.is_available())
            count = int(npu.device_count()) if available else 0
        except Exception as exc:  # noqa: BLE001 - a runtime that cannot answer is unavailable
            return ProbeResult(False, f"torch.npu.is_available() raised {type(exc).__name__}: {exc}",
                               details=details)
        if not available or count == 0:
            return ProbeResult(False, "torch_npu imports but torch.npu.is_available() is False: no NPU is "
                               "visible (check the driver and ASCEND_RT_VISIBLE_DEVICES)", details=details)
        return ProbeResult(True, "", count, details=details)

    def capabilities(self) -> frozenset[str]:
        npu = runtime.npu_module()
        if npu is None:
            return frozenset()
        caps = {"streams", "events", "rng", "memory_stats", "pinned", "fp16", "bf16"}
        if hasattr(npu, "NPUGraph") and hasattr(npu, "graph"):
            caps.add("graphs")
        if self._host_register_binding()[0] is not None:
            caps.add("host_register")
        return frozenset(caps)

    def _device_module(self, required: bool = True):
        npu = runtime.npu_module()
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
            raise PolyaccelError(
                f"npu: npuHostRegister({ptr:#x}, {nbytes}, ACL_HOST_REG_MAPPED) failed with ACL error {rc}; "
                f"the buffer was not registered (range must be {runtime.HOST_REGISTER_ALIGNMENT}-byte aligned "
                "and not overlap a registered range)"
            )

    def _host_unregister(self, ptr: int) -> None:
        binding, reason = self._host_register_binding()
        if binding is None:
            raise Unsupported(self.name, "host_register", reason)
        rc = int(binding.npuHostUnregister(ptr))
        if rc != 0:
            raise PolyaccelError(
                f"npu: npuHostUnregister({ptr:#x}) failed with ACL error {rc}; the buffer is kept alive "
                "(never freed) because the device may still access it"
            )

    # ------------------------------------------------------------------ graphs
    def create_graph(self):
        self.require("graphs", "this torch_npu has no torch.npu.NPUGraph; use eager execution")
        return self._device_module().NPUGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        self.require("graphs", "this torch_npu has no torch.npu.graph; use eager execution")
        return self._device_module().graph(graph, pool=pool, stream=stream)
