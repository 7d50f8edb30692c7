"""Biren GPUs through torch_supa: bccl, SUPAGraph, supaHostRegister through torch.supa.supart()."""

from __future__ import annotations

import sys

from polyaccel.errors import Unsupported
from polyaccel.vendor_extension import ExtensionAccelerator

from . import runtime


class SupaAccelerator(ExtensionAccelerator):
    name = "supa"
    device_type = "supa"
    #: above the CUDA-like plugins: torch_supa also answers as torch.cuda, SUPA must win
    priority = 110
    communication_backend = "bccl" if sys.platform != "win32" else "gloo"
    comm_binds_device = True
    graph_class = "SUPAGraph"
    vendor = runtime.TORCH_SUPA
    #: what torch.supa provides wherever torch_supa imports
    device_claims = ("streams", "events", "rng", "memory_stats", "pinned", "fp16", "bf16")

    def host_register_offered(self) -> bool:
        return hasattr(runtime.TORCH_SUPA.device_module(), "supart")

    def report_facts(self) -> dict | None:
        mod, reason = runtime.TORCH_SUPA.load()
        if mod is None:
            return None if runtime.TORCH_SUPA.is_not_installed(reason) else {"runtime": reason}
        binding, why = runtime.supart_binding()
        ops = runtime.deepspeed_ops()
        kernels = [k for k in ("multi_tensor_adam", "multi_tensor_lion", "lamb") if hasattr(ops, k)] if ops else []
        return {
            **runtime.TORCH_SUPA.facts(mod),
            "host_register": "supaHostRegister" if binding else why,
            "torch_supa_ext kernels": kernels or "torch_supa_ext not installed: optimizers use the reference",
        }

    def _device_module(self, required: bool = True):
        supa = runtime.TORCH_SUPA.device_module()
        if supa is None and required:
            raise Unsupported(self.name, "torch.supa", "import torch_supa on a Biren host")
        return supa

    # --------------------------------------------------------- host memory
    def _binding(self):
        binding, reason = runtime.supart_binding()
        if binding is None:
            raise Unsupported(self.name, "host_register", reason)
        return binding

    def _error_string(self, rc: int) -> str:
        """The runtime's words for ``rc``: ``torch.supa.check_error`` raises with them."""
        try:
            runtime.TORCH_SUPA.device_module().check_error(rc)
        except RuntimeError as exc:
            return str(exc)
        return ""

    def _host_register(self, ptr: int, nbytes: int) -> None:
        rc = int(self._binding().supaHostRegister(ptr, nbytes, runtime.SUPA_HOST_REGISTER_DEFAULT))
        if rc != 0:
            raise self.runtime_call_error(f"supaHostRegister({ptr:#x}, {nbytes}, 0)", rc, self._error_string(rc))

    def _host_unregister(self, ptr: int) -> None:
        rc = int(self._binding().supaHostUnregister(ptr))
        if rc != 0:
            raise self.runtime_call_error(f"supaHostUnregister({ptr:#x})", rc, self._error_string(rc),
                                          unregistering=True)
