"""NVIDIA GPUs through ``torch.cuda``: the whole accelerator contract, honestly declared.

What this backend adds to the base class:

* probing that asks the runtime (and refuses ROCm and SUPA builds of torch, whose
  ``torch.cuda`` is not NVIDIA's: the rocm and supa plugins serve those);
* capabilities read off the device (bf16 on sm80+, fp8 on sm89+, Triton where it compiles);
* host registration of existing buffers with ``cudaHostRegister`` through ``torch.cuda.cudart()``,
  with return codes checked (the base class does the refcounting and never frees a buffer
  whose unregistration failed);
* real CUDA graphs (``torch.cuda.CUDAGraph`` / ``torch.cuda.graph``).

``cudaHostRegister`` takes any address and length (it pins the pages covering them), so the
exact range is registered (the base class's alignment of 1): rounding out to pages would make
neighbouring buffers that share a page collide ("already registered").
"""

from __future__ import annotations

import ctypes
import functools

import torch
from polyaccel.accelerator import Accelerator, ProbeResult

#: cudaHostRegister flags (cuda_runtime_api.h); Portable: every context sees the registration
CUDA_HOST_REGISTER_DEFAULT = 0x00
CUDA_HOST_REGISTER_PORTABLE = 0x01
#: Oldest NVIDIA compute capability Triton 3.x generates code for.
MIN_TRITON_CAPABILITY = (7, 5)


def _foreign_cuda_reason() -> str:
    """Why ``torch.cuda`` here is not NVIDIA's CUDA ("" when it is)."""
    hip = getattr(torch.version, "hip", None)
    if hip:
        return f"this torch is a ROCm build (torch.version.hip={hip}); the rocm plugin serves it"
    if hasattr(torch, "supa"):
        return "torch_supa is loaded (its torch.cuda is Biren's SUPA runtime); the supa plugin serves it"
    return ""


@functools.cache
def runtime_function(library: str, symbol: str):
    """``symbol`` of the runtime library torch already loaded (found in /proc/self/maps), or None.

    torch's ``cudart()`` bindings return an error code but leave the runtime's *last error* set;
    torch checks that last error after every kernel launch, so a refused cudaHostRegister would
    surface as a bogus failure of the next unrelated kernel. Clearing it needs the same runtime
    instance torch uses: dlopen of an already-loaded path returns that instance.
    """
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if library in path.rsplit("/", 1)[-1] and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    for path in paths + [None]:
        try:
            return getattr(ctypes.CDLL(path), symbol)
        except (OSError, AttributeError):
            continue
    return None


class CudaAccelerator(Accelerator):
    name = "cuda"
    device_type = "cuda"
    priority = 100
    communication_backend = "nccl"
    #: NCCL (RCCL for rocm, same torch.distributed name) binds a communicator to one GPU: giving
    #: ``init_process_group`` the ``device_id`` lets it connect eagerly and spares torch the device
    #: guess on the first collective
    comm_binds_device = True
    #: name of the collective library behind ``communication_backend`` (for reports)
    collective_library = "nccl"
    host_register_flags = CUDA_HOST_REGISTER_PORTABLE
    #: the runtime library and its "read and reset the last error" function
    runtime_library = "libcudart"
    last_error_symbol = "cudaGetLastError"
    graph_class = "CUDAGraph"

    # ------------------------------------------------------------------ probe
    def _runtime_reason(self) -> str:
        """Why this torch cannot drive this backend's runtime at all ("" when it can)."""
        foreign = _foreign_cuda_reason()
        if foreign:
            return foreign
        if not getattr(torch.version, "cuda", None):
            return "this torch was built without CUDA (torch.version.cuda is None)"
        return ""

    def probe(self) -> ProbeResult:
        reason = self._runtime_reason()
        if reason:
            return ProbeResult(False, reason)
        try:
            available = torch.cuda.is_available()
            count = torch.cuda.device_count() if available else 0
        except Exception as exc:  # noqa: BLE001 - a broken driver is "unavailable, because ..."
            return ProbeResult(False, f"querying the CUDA driver failed: {type(exc).__name__}: {exc}")
        if not available or count < 1:
            return ProbeResult(False, "torch.cuda.is_available() is False: no usable GPU or driver")
        return ProbeResult(True, "", count, details={"torch_cuda": torch.version.cuda})

    # ---------------------------------------------------------- capabilities
    def device_capability(self, index: int | None = None) -> tuple[int, int]:
        return tuple(torch.cuda.get_device_capability(self.current_device() if index is None else index))

    def _fp8_native(self) -> bool:
        return self.device_capability() >= (8, 9)

    def _bf16_native(self) -> bool:
        return self.device_capability() >= (8, 0)

    def triton_device_support(self) -> tuple[bool, str]:
        """Whether Triton compiles for this GPU (asked by :func:`triton_support.triton_compatible`)."""
        cap = self.device_capability()
        if cap < MIN_TRITON_CAPABILITY:
            return False, (f"compute capability {cap[0]}.{cap[1]} is older than "
                           f"{MIN_TRITON_CAPABILITY[0]}.{MIN_TRITON_CAPABILITY[1]}, the oldest Triton supports")
        return True, ""

    def _triton_ok(self) -> bool:
        from .triton_support import triton_compatible

        return triton_compatible(self)[0]

    @functools.cached_property
    def _capabilities(self) -> frozenset[str]:
        caps = {"streams", "events", "graphs", "host_register", "pinned", "async_p2p", "memory_stats", "rng",
                "fp64", "fp16"}
        if not self.probe().available:
            return frozenset()
        if self._bf16_native():
            caps.add("bf16")
        if self._fp8_native() and self.fp8_dtypes():
            caps.add("fp8")
        if self._triton_ok():
            caps.add("triton")
        return frozenset(caps)

    def capabilities(self) -> frozenset[str]:
        return self._capabilities

    def fp8_dtypes(self) -> tuple[torch.dtype, ...]:
        if not self._fp8_native():
            return ()
        return tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))

    def describe(self) -> str:
        try:
            props = torch.cuda.get_device_properties(self.current_device())
            major, minor = self.device_capability()
            return f"{self.name}: {props.name} (sm_{major}{minor}, {props.total_memory / 2**30:.0f} GiB)"
        except Exception:  # noqa: BLE001 - describe() must never fail
            return super().describe()

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]  # HIP builds of torch read it too

    # ------------------------------------------------------- comm and report
    def report_facts(self) -> dict | None:
        if not self.probe().available:
            return None
        from .report import report

        return report(self)

    # --------------------------------------------------------- pinned memory
    def _cudart(self):
        return torch.cuda.cudart()

    def _error_string(self, cudart, rc) -> str:
        try:
            return str(cudart.cudaGetErrorString(rc))
        except Exception:  # noqa: BLE001 - the code alone still identifies the error
            return "unknown error"

    def _clear_last_error(self) -> bool:
        """Reset the runtime's last error after a refused call; False when the runtime is unreachable."""
        fn = runtime_function(self.runtime_library, self.last_error_symbol)
        if fn is None:
            return False
        fn()
        return True

    def _host_register(self, ptr: int, nbytes: int) -> None:
        cudart = self._cudart()
        rc = cudart.cudaHostRegister(ptr, nbytes, self.host_register_flags)
        if int(rc) != 0:
            self._clear_last_error()
            raise self.runtime_call_error(f"cudaHostRegister({ptr:#x}, {nbytes})", int(rc),
                                          self._error_string(cudart, rc),
                                          hint="the buffer stays unregistered (use pin_memory() for a pinned copy "
                                               "instead)")

    def _host_unregister(self, ptr: int) -> None:
        cudart = self._cudart()
        rc = cudart.cudaHostUnregister(ptr)
        if int(rc) != 0:
            self._clear_last_error()
            raise self.runtime_call_error(f"cudaHostUnregister({ptr:#x})", int(rc), self._error_string(cudart, rc),
                                          unregistering=True)

    # ---------------------------------------------------------------- graphs
    def graph_pool_handle(self):
        """A memory pool id to share between captures (``torch.cuda.graph_pool_handle()``)."""
        self.require("graphs")
        return torch.cuda.graph_pool_handle()
