"""Emulated Intel GPU runtime: ``torch.xpu`` (torch >= 2.5) plus the optional pieces around it.

Offered through the plugin's ``polyaccel_emulated_runtimes`` hook;
``polyaccel.testing.emulation.emulate("xpu", **options)`` patches the real ``torch.xpu`` module in place (it is what
``torch.get_device_module("xpu")`` returns) so that ``torch.xpu.is_available()`` is true,
and provides devices, streams and events on an asynchronous queue, RNG (the host's
generator, since emulated tensors are host tensors), memory statistics (counted from the
storages ops create while it is active), ``XPUGraph``/``graph`` (capture records aten ops,
replay re-runs them), host pinning through ``Tensor.pin_memory(device="xpu")``, the xccl
check of ``torch.distributed``, optionally the oneCCL bindings, and optionally an
installed intel-extension-for-pytorch of any version that behaves like the released ones:
with a torch of another major.minor its import prints the refusal and calls
``os.exit(127)``.
Tensors stay on the CPU. Proves the plugin's logic, not the hardware.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata as md
import re
import types
from typing import Any

import torch
from polyaccel.testing.emulation import (
    EMULATED_MARKER,
    EmulatedEvent,
    EmulatedRuntime,
    EmulatedStream,
    GraphRecorder,
    Patcher,
    PinnedHost,
    mark_emulated,
)

from .accelerator import XpuAccelerator

IPEX_MODULE = "intel_extension_for_pytorch"
IPEX_DIST = "intel-extension-for-pytorch"
ONECCL_MODULE = "oneccl_bindings_for_pytorch"
DEVICE_NAME = "Intel(R) Data Center GPU Max 1550 (emulated)"
TOTAL_MEMORY = 64 * 2**30


def _torch_major_minor() -> str:
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return f"{m.group(1)}.{m.group(2)}"


def _device_index(device: Any, current: int) -> int:
    if device is None:
        return current
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        return current if device.index is None else device.index
    raise TypeError(f"invalid xpu device {device!r}")


# ------------------------------------------------------------------ IPEX stand-in
class _FakeIpexDistribution(md.Distribution):
    def __init__(self, version: str):
        self._version = version

    def read_text(self, filename):
        if filename in ("METADATA", "PKG-INFO"):
            return f"Metadata-Version: 2.1\nName: {IPEX_DIST}\nVersion: {self._version}\n"
        return None

    def locate_file(self, path):
        return path


class _FakeIpexFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the stand-in IPEX package and (unless told otherwise) its distribution metadata."""

    def __init__(self, runtime: XpuRuntime, version: str, metadata: bool, exit_call: str):
        self.runtime = runtime
        self.version = version
        self.metadata = metadata
        self.exit_call = exit_call

    def find_spec(self, fullname, path=None, target=None):
        if fullname != IPEX_MODULE:
            return None
        return importlib.machinery.ModuleSpec(IPEX_MODULE, self, is_package=True)

    def find_distributions(self, context=md.DistributionFinder.Context()):
        if not self.metadata:
            return iter(())
        name = getattr(context, "name", None)
        if name is not None and re.sub(r"[-_.]+", "-", name).lower() != IPEX_DIST:
            return iter(())
        return iter([_FakeIpexDistribution(self.version)])

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        """What the released ``intel_extension_for_pytorch/__init__.py`` does first: check torch."""
        self.runtime.record("ipex.import", self.version)
        want = ".".join(self.version.split(".")[:2])
        have = _torch_major_minor()
        if want != have:
            print(f"ERROR! Intel® Extension for PyTorch* needs to work with PyTorch {want}.*, but PyTorch "
                  f"{torch.__version__} is found. Please switch to the matching version and run again.")
            if self.exit_call == "sys.exit":
                import sys

                sys.exit(127)
            import os

            os.exit(127)  # sic: the released package calls this nonexistent function
        module.__version__ = self.version
        mark_emulated(module)


# ---------------------------------------------------------------- graph stand-in
class _EmulatedXPUGraph:
    """Stand-in for ``torch.xpu.XPUGraph``: capture records, replay recomputes."""

    def __init__(self, runtime: XpuRuntime, keep_graph: bool = False):
        self._runtime = runtime
        self._recorder = GraphRecorder()
        self._pool = object()
        mark_emulated(self)

    def capture_begin(self, pool=None):
        self._runtime.record("XPUGraph.capture_begin", pool=pool)
        self._runtime.capturing += 1
        self._recorder.begin()

    def capture_end(self):
        self._recorder.end()
        self._runtime.capturing -= 1
        self._runtime.record("XPUGraph.capture_end", len(self._recorder.ops))

    def instantiate(self):
        self._runtime.record("XPUGraph.instantiate")

    def replay(self):
        self._runtime.record("XPUGraph.replay")
        self._recorder.replay()

    def reset(self):
        self._recorder.reset()

    def pool(self):
        return self._pool

    @property
    def replays(self) -> int:
        return self._recorder.replays


class _EmulatedGraphContext:
    """Stand-in for ``torch.xpu.graph``: current side stream + capture_begin/capture_end."""

    def __init__(self, runtime: XpuRuntime, xpu_graph, pool=None, stream=None):
        self._runtime = runtime
        self.xpu_graph = xpu_graph
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream if stream is not None else EmulatedStream(runtime)
        self._stream_ctx = None

    def __enter__(self):
        self._runtime.synchronize_all()
        self._stream_ctx = self._runtime.use_stream(self.capture_stream)
        self._stream_ctx.__enter__()
        self.xpu_graph.capture_begin(*self.pool)

    def __exit__(self, *exc):
        try:
            self.xpu_graph.capture_end()
        finally:
            self._stream_ctx.__exit__(*exc)


# ----------------------------------------------------------------------- runtime
class XpuRuntime(EmulatedRuntime):
    name = "xpu"
    accelerator = XpuAccelerator
    FAULTS = {
        "no_device": "torch.xpu.is_available() is False (no Intel GPU / driver)",
        "no_graphs": "this torch has no torch.xpu.XPUGraph / torch.xpu.graph",
        "no_xccl": "torch.distributed.is_xccl_available() is False",
        "oneccl": "oneccl_bindings_for_pytorch imports (and would register the 'ccl' backend)",
        "no_fp64": "the device has no fp64 (get_device_properties().has_fp64 is False)",
        "no_bf16": "torch.xpu.is_bf16_supported() is False",
        "no_fused_adam": "torch has no fused Adam kernel for xpu",
        "ipex": "version of an installed intel-extension-for-pytorch; 'match' = the running torch's major.minor",
        "ipex_no_metadata": "that IPEX has no distribution metadata (its version is known only by importing it)",
        "ipex_exit": "the exit call of a refusing IPEX import: 'os.exit' (as released, an AttributeError) "
                     "or 'sys.exit'",
    }

    def __init__(self, device_count: int = 2, polls_to_complete: int = 1, track_allocations: bool = True,
                 **faults: Any):
        super().__init__(polls_to_complete=polls_to_complete, **faults)
        self.device_count = device_count
        self.current = 0
        self.capturing = 0
        self.track_allocations = track_allocations
        #: torch's XPU host allocator (``Tensor.pin_memory()``), emulated: a tracked copy
        self.pinned_host = PinnedHost(self)

    # ------------------------------------------------------------ torch.xpu API
    def _check_index(self, index: int) -> int:
        if not 0 <= index < self.device_count:
            raise RuntimeError(f"XPU error: invalid device ordinal {index} (device count {self.device_count})")
        return index

    def _gen(self, device=None) -> torch.Generator:
        """Emulated devices keep their tensors on the host, so they draw from the host's generator."""
        self._check_index(_device_index(device, self.current))
        return torch.default_generator

    def _xpu_api(self) -> dict[str, Any]:
        rt = self

        def is_available() -> bool:
            rt.record("is_available")
            return not rt.faults.no_device

        def device_count() -> int:
            return 0 if rt.faults.no_device else rt.device_count

        def set_device(device) -> None:
            rt.current = rt._check_index(_device_index(device, rt.current))
            rt.record("set_device", rt.current)

        def synchronize(device=None) -> None:
            rt.record("synchronize", device)
            rt.synchronize_all()

        def get_device_properties(device=None):
            idx = rt._check_index(_device_index(device, rt.current))
            return types.SimpleNamespace(name=DEVICE_NAME, total_memory=TOTAL_MEMORY, has_fp64=not rt.faults.no_fp64,
                                         has_fp16=True, max_compute_units=1024, index=idx)

        def manual_seed(seed) -> None:
            rt._gen().manual_seed(int(seed))

        def manual_seed_all(seed) -> None:
            torch.default_generator.manual_seed(int(seed))

        def seed() -> None:
            rt._gen().seed()

        def mem_get_info(device=None):
            return TOTAL_MEMORY - rt.memory.reserved, TOTAL_MEMORY

        @contextlib.contextmanager
        def stream(s):
            with rt.use_stream(s):
                yield

        def set_stream(s) -> None:
            rt._current_stream = s

        return {
            "is_available": is_available,
            "device_count": device_count,
            "current_device": lambda: rt.current,
            "set_device": set_device,
            "synchronize": synchronize,
            "is_initialized": lambda: True,
            "init": lambda: None,
            "_is_compiled": lambda: True,
            "get_device_name": lambda device=None: get_device_properties(device).name,
            "get_device_properties": get_device_properties,
            "get_device_capability": lambda device=None: {"architecture": 0},
            "is_bf16_supported": lambda including_emulation=True: not rt.faults.no_bf16,
            "Stream": lambda device=None, priority=0, **kw: EmulatedStream(rt, device, priority, **kw),
            "Event": lambda enable_timing=False, **kw: EmulatedEvent(rt, enable_timing=enable_timing),
            "current_stream": lambda device=None: rt.current_stream(),
            "stream": stream,
            "set_stream": set_stream,
            "manual_seed": manual_seed,
            "manual_seed_all": manual_seed_all,
            "seed": seed,
            "initial_seed": lambda: rt._gen().initial_seed(),
            "get_rng_state": lambda device="xpu": rt._gen(device).get_state(),
            "set_rng_state": lambda new_state, device="xpu": rt._gen(device).set_state(new_state),
            "memory_allocated": lambda device=None: rt.memory.allocated,
            "max_memory_allocated": lambda device=None: rt.memory.peak,
            "memory_reserved": lambda device=None: rt.memory.reserved,
            "max_memory_reserved": lambda device=None: rt.memory.reserved,
            "reset_peak_memory_stats": lambda device=None: rt.memory.reset_peak(),
            "memory_stats": lambda device=None: rt.memory.stats(),
            "empty_cache": lambda: rt.memory.empty_cache(),
            "mem_get_info": mem_get_info,
        }

    # ---------------------------------------------------------------- install
    def install(self, patcher: Patcher) -> None:
        # torch._dynamo reads torch.xpu._is_compiled() once, at import, and then binds XPU
        # internals that a CPU build lacks: import it while the real answer is still in place
        import torch._dynamo  # noqa: F401

        xpu = torch.xpu
        for name, fn in self._xpu_api().items():
            patcher.setattr(xpu, name, fn)
        patcher.setattr(xpu, EMULATED_MARKER, True)  # torch.xpu is patched in place: undone on exit
        if self.faults.no_graphs:
            for name in ("XPUGraph", "graph", "graph_pool_handle", "graphs"):
                patcher.delattr(xpu, name)
        else:
            patcher.setattr(xpu, "XPUGraph", lambda keep_graph=False: _EmulatedXPUGraph(self, keep_graph))
            patcher.setattr(xpu, "graph", lambda g, pool=None, stream=None: _EmulatedGraphContext(self, g, pool,
                                                                                                   stream))
            patcher.setattr(xpu, "graph_pool_handle", lambda: object())
            patcher.setattr(xpu, "is_current_stream_capturing", lambda: self.capturing > 0)
        self.pinned_host.install(patcher, "xpu")
        if self.track_allocations:
            self.install_allocation_tracking(patcher)
        self._install_comm(patcher)
        self._install_fused_kernels(patcher)
        if self.faults.ipex:
            self._install_ipex(patcher)

    def _install_comm(self, patcher: Patcher) -> None:
        import torch.distributed as dist

        patcher.setattr(dist, "is_xccl_available", lambda: not self.faults.no_xccl)
        if self.faults.oneccl:
            mod = types.ModuleType(ONECCL_MODULE)
            mod.__version__ = f"{_torch_major_minor()}.0+emulated"
            mark_emulated(mod)
            patcher.set_module(ONECCL_MODULE, mod)
        else:
            err = ModuleNotFoundError(f"No module named {ONECCL_MODULE!r}")
            err.name = ONECCL_MODULE
            patcher.fail_import(ONECCL_MODULE, err)

    def _install_fused_kernels(self, patcher: Patcher) -> None:
        from torch.utils import _foreach_utils

        real = _foreach_utils._get_fused_kernels_supported_devices

        def supported() -> list[str]:
            devices = [d for d in real() if d != "xpu"]
            return devices if self.faults.no_fused_adam else devices + ["xpu"]

        patcher.setattr(_foreach_utils, "_get_fused_kernels_supported_devices", supported)

    def _install_ipex(self, patcher: Patcher) -> None:
        import sys

        version = self.faults.ipex
        if version == "match":
            version = f"{_torch_major_minor()}.0"
        patcher.remove_module(IPEX_MODULE)
        finder = _FakeIpexFinder(self, str(version), metadata=not self.faults.ipex_no_metadata,
                                 exit_call=self.faults.ipex_exit or "os.exit")
        sys.meta_path.insert(0, finder)
        patcher.on_exit(lambda: sys.meta_path.remove(finder))
        patcher.on_exit(lambda: [sys.modules.pop(k) for k in list(sys.modules)
                                 if k == IPEX_MODULE or k.startswith(IPEX_MODULE + ".")])

