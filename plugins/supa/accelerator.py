"""Biren GPUs through torch_supa: bccl, SUPAGraph, supaHostRegister through torch.supa.supart()."""

from __future__ import annotations

import sys

from polyaccel.accelerator import Accelerator, ProbeResult
from polyaccel.errors import PolyaccelError, Unsupported

from . import runtime


class SupaAccelerator(Accelerator):
    name = "supa"
    device_type = "supa"
    #: above the CUDA-like plugins: torch_supa also answers as torch.cuda, SUPA must win
    priority = 110
    communication_backend = "bccl" if sys.platform != "win32" else "gloo"

    def probe(self) -> ProbeResult:
        mod, reason = runtime.import_torch_supa()
        if mod is None:
            return ProbeResult(False, reason)
        supa = runtime.supa_module()
        details = {"torch_supa": getattr(mod, "__version__", "unknown")}
        try:
            available = bool(supa.is_available())
            count = int(supa.device_count()) if available else 0
        except Exception as exc:  # noqa: BLE001
            return ProbeResult(False, f"torch.supa.is_available() raised {type(exc).__name__}: {exc}",
                               details=details)
        if not available or count == 0:
            return ProbeResult(False, "torch_supa imports but torch.supa.is_available() is False: no SUPA "
                               "device is visible (check the driver and SUPA_VISIBLE_DEVICES)", details=details)
        return ProbeResult(True, "", count, details=details)

    def capabilities(self) -> frozenset[str]:
        supa = runtime.supa_module()
        if supa is None:
            return frozenset()
        caps = {"streams", "events", "rng", "memory_stats", "pinned", "fp16", "bf16"}
        if hasattr(supa, "SUPAGraph") and hasattr(supa, "graph"):
            caps.add("graphs")
        if hasattr(supa, "supart"):
            caps.add("host_register")
        return frozenset(caps)

    def _device_module(self, required: bool = True):
        supa = runtime.supa_module()
        if supa is None and required:
            raise Unsupported(self.name, "torch.supa", "import torch_supa on a Biren host")
        return supa

    # --------------------------------------------------------- host memory
    def _binding(self):
        binding, reason = runtime.supart_binding()
        if binding is None:
            raise Unsupported(self.name, "host_register", reason)
        return binding

    def _check(self, call: str, rc: int) -> None:
        if rc == 0:
            return
        supa = runtime.supa_module()
        try:
            supa.check_error(rc)
            detail = ""
        except RuntimeError as exc:
            detail = f": {exc}"
        raise PolyaccelError(f"supa: {call} failed with error {rc}{detail}")

    def _host_register(self, ptr: int, nbytes: int) -> None:
        rc = int(self._binding().supaHostRegister(ptr, nbytes, runtime.SUPA_HOST_REGISTER_DEFAULT))
        self._check(f"supaHostRegister({ptr:#x}, {nbytes}, 0)", rc)

    def _host_unregister(self, ptr: int) -> None:
        rc = int(self._binding().supaHostUnregister(ptr))
        if rc != 0:
            try:
                self._check(f"supaHostUnregister({ptr:#x})", rc)
            except PolyaccelError as exc:
                raise PolyaccelError(f"{exc}; the buffer is kept alive (never freed) because the device may "
                                     "still access it") from None

    # ------------------------------------------------------------------ graphs
    def create_graph(self):
        self.require("graphs", "this torch_supa has no torch.supa.SUPAGraph; use eager execution")
        return self._device_module().SUPAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        self.require("graphs", "this torch_supa has no torch.supa.graph; use eager execution")
        return self._device_module().graph(graph, pool=pool, stream=stream)
