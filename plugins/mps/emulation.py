"""Emulated Apple GPU runtime: ``torch.mps`` and ``torch.backends.mps``, with Metal kernels run on the host.

Offered through the plugin's ``polyaccel_emulated_runtimes`` hook;
``polyaccel.testing.emulation.emulate("mps", **options)`` patches the real modules in place:
one device, RNG (the host's generator, since emulated tensors are host tensors), events on
an asynchronous queue, torch.mps's memory counters, pinning into the "shared allocator"
through ``Tensor.pin_memory(device="mps")``, and ``torch.mps.compile_shader``.

The emulated ``compile_shader`` records the source and compiles it *for the host*: the
Metal source text is compiled as C++ against a small shim (``device``/``constant``
address spaces, ``half``, ``bfloat``, ``metal::`` maths, ``[[thread_position_in_grid]]``),
and a kernel call checks its arguments against the kernel's declared parameters the way
torch binds them (tensor -> ``device T*`` of the same dtype, Python float -> ``constant
float&``, Python int -> ``constant long&``) and then runs the kernel once per grid index.
So the numbers come from the very source that a real device would compile, run
sequentially on the CPU.

What that does not prove: that Metal's compiler accepts the source, the GPU's parallel
execution and fast-math rounding, and performance. Supported subset: kernels written out
as ``kernel void name(...)`` (no templates or macro-generated kernels) with a 1-D grid.
Tensors stay on the CPU.

Compiled libraries are cached per user (``$POLYACCEL_METAL_EMULATION_CACHE``, else
``$XDG_CACHE_HOME/polyaccel/metal-emulation`` or ``~/.cache/polyaccel/metal-emulation``); a
cache folder or library that another user could have written is refused, never loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import torch
from polyaccel.errors import PolyaccelError
from polyaccel.safe_files import write_atomic
from polyaccel.testing.emulation import (
    EMULATED_MARKER,
    EmulatedEvent,
    EmulatedRuntime,
    Patcher,
    PinnedHost,
    mark_emulated,
)

from .accelerator import MpsAccelerator

RECOMMENDED_MAX_MEMORY = 48 * 2**30

#: Metal scalar types the host shim knows, with the torch dtype a buffer of them holds
METAL_DTYPES = {
    "float": torch.float32, "half": torch.float16, "bfloat": torch.bfloat16, "int": torch.int32,
    "uint": torch.uint32, "long": torch.int64, "ulong": torch.uint64, "short": torch.int16,
    "ushort": torch.uint16, "char": torch.int8, "uchar": torch.uint8, "bool": torch.bool,
}

_SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#define kernel
#define device
#define constant const
#define thread
#define threadgroup
typedef unsigned int uint;
typedef unsigned long ulong;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;
struct bfloat {
    uint16_t bits;
    bfloat() : bits(0) {}
    bfloat(float f) {
        uint32_t u; std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) { bits = (uint16_t)((u >> 16) | 0x40u); return; }
        u += 0x7fffu + ((u >> 16) & 1u);
        bits = (uint16_t)(u >> 16);
    }
    operator float() const { uint32_t u = (uint32_t)bits << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
namespace metal {
using std::sqrt; using std::abs; using std::fabs; using std::fma; using std::exp; using std::log; using std::pow;
using std::max; using std::min; using std::floor; using std::ceil; using std::round; using std::tanh;
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
namespace precise { using std::sqrt; }
namespace fast { using std::sqrt; }
}
"""

_KERNEL_RE = re.compile(r"\bkernel\s+void\s+(\w+)\s*\(([^)]*)\)", re.S)
_ATTR_RE = re.compile(r"\[\[([^\]]*)\]\]")


@dataclass(frozen=True)
class KernelParam:
    name: str
    kind: str  # "buffer", "scalar" or "index"
    metal_type: str
    const: bool = False


def parse_kernels(source: str) -> dict[str, list[KernelParam]]:
    """Kernel name -> its parameters, from ``kernel void name(...)`` declarations."""
    kernels: dict[str, list[KernelParam]] = {}
    for match in _KERNEL_RE.finditer(source):
        params = []
        for raw in (p.strip() for p in match.group(2).split(",")):
            if not raw:
                continue
            attrs = _ATTR_RE.findall(raw)
            decl = _ATTR_RE.sub("", raw).strip()
            tokens = decl.replace("*", " * ").replace("&", " & ").split()
            name = tokens[-1]
            types = [t for t in tokens[:-1] if t in METAL_DTYPES]
            if not types:
                raise RuntimeError(f"emulated Metal: kernel {match.group(1)!r} parameter {raw!r} has a type the "
                                   f"host shim does not know (known: {sorted(METAL_DTYPES)})")
            if any("thread_position_in_grid" in a for a in attrs):
                kind = "index"
            elif "*" in tokens:
                kind = "buffer"
            elif "&" in tokens:
                kind = "scalar"
            else:
                raise RuntimeError(f"emulated Metal: kernel {match.group(1)!r} parameter {raw!r} is neither a buffer, "
                                   f"a constant reference nor [[thread_position_in_grid]]")
            params.append(KernelParam(name, kind, types[0], const="const" in tokens))
        if sum(p.kind == "index" for p in params) != 1:
            raise RuntimeError(f"emulated Metal: kernel {match.group(1)!r} needs exactly one "
                               f"[[thread_position_in_grid]] index (1-D grid)")
        kernels[match.group(1)] = params
    return kernels


def _launcher(name: str, params: list[KernelParam]) -> str:
    args, slot = [], 0
    for p in params:
        if p.kind == "index":
            args.append(f"({p.metal_type})i")
            continue
        cast = f"({p.metal_type}*)a[{slot}]"
        args.append(cast if p.kind == "buffer" else f"*{cast}")
        slot += 1
    return (f'extern "C" void polyaccel_launch_{name}(void** a, unsigned long long n) {{\n'
            f"    for (unsigned long long i = 0; i < n; ++i) {name}({', '.join(args)});\n}}\n")


#: environment variable naming the folder compiled shader libraries are cached in
CACHE_ENV = "POLYACCEL_METAL_EMULATION_CACHE"


class UnsafeCacheError(PolyaccelError):
    """The shader cache folder, or a library in it, could have been written by another user."""


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/polyaccel/metal-emulation``, else ``~/.cache/polyaccel/metal-emulation``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative value is ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "polyaccel", "metal-emulation")


def _uid() -> int | None:
    """The current user's uid; None where the platform has no POSIX owners (no checks there)."""
    return os.getuid() if hasattr(os, "getuid") else None


def _mode(st: os.stat_result) -> str:
    return oct(stat.S_IMODE(st.st_mode))


def _check_cache_folder(folder: str, configured: str | None) -> None:
    """Refuse ``folder`` unless only the current user (and root) can change what it holds."""
    uid = _uid()
    if uid is None:
        return
    origin = (f"{CACHE_ENV}={configured}" if configured
              else f"the default, under $XDG_CACHE_HOME or ~/.cache; {CACHE_ENV} overrides it")
    where = f"the emulated Metal shader cache folder {folder} ({origin})"
    elsewhere = f"or set {CACHE_ENV} to a folder of your own (it is created with mode 0700)"
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheError(f"refusing {where}: it is not a folder. Remove it, {elsewhere}.")
    if st.st_uid != uid:
        raise UnsafeCacheError(
            f"refusing {where}: it is owned by uid {st.st_uid}, not by the current user (uid {uid}), so a "
            f"library in it could have been planted by someone else. Remove that folder (as its owner or "
            f"root), {elsewhere}.")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheError(
            f"refusing {where}: it is group/world-writable (mode {_mode(st)}), so another user could plant a "
            f"library in it. Run `chmod 700 {folder}`, {elsewhere}.")
    parent = folder
    while True:
        parent, child = os.path.split(parent)
        if not child:
            break
        pst = os.lstat(parent)
        if pst.st_uid not in (uid, 0):
            problem = f"is owned by uid {pst.st_uid} (neither the current user, uid {uid}, nor root)"
        elif pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
            problem = f"is world-writable without the sticky bit (mode {_mode(pst)})"
        else:
            continue
        raise UnsafeCacheError(
            f"refusing {where}: the folder above it, {parent}, {problem}, so another user could replace the "
            f"cache folder. Set {CACHE_ENV} to a folder that only you (and root) can change.")


def _check_cached_library(path: str) -> bool:
    """False when ``path`` does not exist; raises unless it is a regular file only the current user can write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    uid = _uid()
    if uid is None:
        return True
    fix = "Delete it; the library is rebuilt on the next run."
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCacheError(f"refusing to load the cached emulated Metal library {path}: it is not a regular "
                               f"file (a symbolic link or another kind of entry). {fix}")
    if st.st_uid != uid:
        raise UnsafeCacheError(f"refusing to load the cached emulated Metal library {path}: it is owned by uid "
                               f"{st.st_uid}, not by the current user (uid {uid}). {fix}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheError(f"refusing to load the cached emulated Metal library {path}: it is "
                               f"group/world-writable (mode {_mode(st)}). {fix}")
    return True


class _HostBuild:
    """Compiles translated sources for the host, cached on disk by the hash of compiler + source.

    The cache (``$POLYACCEL_METAL_EMULATION_CACHE``, else :func:`default_cache_dir`) is per user
    and shared by that user's processes. The folder is created with mode 0700 and refused
    (:class:`UnsafeCacheError`) when another user owns it, it is group/world-writable, or a
    folder above it is one others can change; a cached library is loaded only when it is a
    regular file of the current user's that no one else can write. A library is written under a
    temporary name in the cache folder and renamed into place, so a concurrent reader never
    loads a half-written file.
    """

    def __init__(self) -> None:
        self._libs: dict[str, ctypes.CDLL] = {}
        self._lock = threading.Lock()

    @staticmethod
    def compiler() -> str:
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
        if not cxx:
            raise RuntimeError("emulated Metal needs a C++ compiler on the host (g++ or clang++, or set CXX)")
        return cxx

    @staticmethod
    def key(cxx: str, cpp: str) -> str:
        """The cached library's file stem for ``cpp`` compiled by ``cxx``."""
        return hashlib.sha256(f"{cxx}\0{cpp}".encode()).hexdigest()[:24]

    @staticmethod
    def cache_dir() -> str:
        """The checked cache folder (created with mode 0700 when missing); raises :class:`UnsafeCacheError`."""
        configured = os.environ.get(CACHE_ENV) or None
        folder = os.path.abspath(os.path.expanduser(configured or default_cache_dir()))
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        folder = os.path.realpath(folder)
        _check_cache_folder(folder, configured)
        return folder

    def build(self, cpp: str) -> ctypes.CDLL:
        cxx = self.compiler()
        key = self.key(cxx, cpp)
        with self._lock:
            lib = self._libs.get(key)
            if lib is not None:
                return lib
            folder = self.cache_dir()
            out = os.path.join(folder, f"{key}.so")
            if not _check_cached_library(out):
                self._compile(cxx, cpp, out)
                _check_cached_library(out)
            lib = ctypes.CDLL(out)
            self._libs[key] = lib
            return lib

    @staticmethod
    def _compile(cxx: str, cpp: str, out: str) -> None:
        def compile_to(part) -> None:
            with tempfile.TemporaryDirectory(prefix="polyaccel-metal-") as tmp:
                src = os.path.join(tmp, "kernel.cpp")
                with open(src, "w") as f:
                    f.write(cpp)
                proc = subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wno-attributes",
                                       "-o", str(part), src], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"emulated Metal: the shader does not compile (as C++ for the host):\n"
                                   f"{proc.stderr[-4000:]}")
            os.chmod(part, 0o700)

        write_atomic(out, compile_to)  # a reader (another process) never loads half a library


_BUILD = _HostBuild()


class EmulatedKernel:
    """One kernel of an emulated shader library: checks the call like torch binds it, then runs it."""

    def __init__(self, runtime: MpsRuntime, name: str, params: list[KernelParam], fn):
        self._runtime = runtime
        self.name = name
        self.params = params
        self._fn = fn
        self.max_threads_per_threadgroup = 1024
        self.thread_execution_width = 32
        mark_emulated(self)

    def _bind(self, args: tuple):
        slots = [p for p in self.params if p.kind != "index"]
        if len(args) != len(slots):
            raise RuntimeError(f"kernel {self.name!r} takes {len(slots)} arguments "
                               f"({', '.join(p.name for p in slots)}), got {len(args)}")
        keep, ptrs, first_numel = [], [], None
        for p, a in zip(slots, args, strict=True):
            if p.kind == "buffer":
                if not isinstance(a, torch.Tensor):
                    raise TypeError(f"kernel {self.name!r}: argument {p.name!r} is a `device {p.metal_type}*` "
                                    f"buffer; got {type(a).__name__}")
                want = METAL_DTYPES[p.metal_type]
                if a.dtype != want:
                    raise TypeError(f"kernel {self.name!r}: buffer {p.name!r} is `{p.metal_type}*` ({want}) but the "
                                    f"tensor is {a.dtype}")
                first_numel = a.numel() if first_numel is None else first_numel
                ptrs.append(a.data_ptr())
                continue
            if isinstance(a, torch.Tensor):
                raise TypeError(f"kernel {self.name!r}: argument {p.name!r} is a `constant {p.metal_type}&`; got "
                                f"a tensor")
            if isinstance(a, float):
                if p.metal_type != "float":
                    raise TypeError(f"kernel {self.name!r}: a Python float binds as `float`, but {p.name!r} is "
                                    f"`constant {p.metal_type}&`")
                box = ctypes.c_float(a)
            elif isinstance(a, int):
                if p.metal_type not in ("long", "ulong"):
                    raise TypeError(f"kernel {self.name!r}: a Python int binds as 64-bit `long`, but {p.name!r} is "
                                    f"`constant {p.metal_type}&`")
                box = ctypes.c_int64(a)
            else:
                raise TypeError(f"kernel {self.name!r}: unsupported argument type {type(a).__name__} for {p.name!r}")
            keep.append(box)
            ptrs.append(ctypes.addressof(box))
        return keep, ptrs, first_numel

    def __call__(self, *args, threads=None, group_size=None, arg_casts=None, error_buf_idx=None):
        if arg_casts is not None or error_buf_idx is not None:
            raise NotImplementedError("emulated Metal dispatch does not model arg_casts/error_buf_idx")
        keep, ptrs, first_numel = self._bind(args)
        if threads is None:
            threads = first_numel
        if isinstance(threads, (list, tuple)):
            if len(threads) != 1:
                raise NotImplementedError("emulated Metal dispatch runs 1-D grids only")
            threads = threads[0]
        if threads is None:
            raise RuntimeError("Number of threads is undefined or has wrong dimension")
        self._runtime.record("dispatch", self.name, threads=int(threads), group_size=group_size)
        array = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
        self._fn(array, ctypes.c_ulonglong(int(threads)))
        del keep


class EmulatedShaderLibrary:
    """What the emulated ``torch.mps.compile_shader`` returns: kernels as attributes."""

    def __init__(self, runtime: MpsRuntime, source: str):
        self.source = source
        kernels = parse_kernels(source)
        translated = source.replace("#include <metal_stdlib>", "")
        cpp = _SHIM + translated + "\n" + "".join(_launcher(n, p) for n, p in kernels.items())
        lib = _BUILD.build(cpp)
        self._kernels = {}
        for name, params in kernels.items():
            fn = getattr(lib, f"polyaccel_launch_{name}")
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
            self._kernels[name] = EmulatedKernel(runtime, name, params, fn)
        mark_emulated(self)

    def __getattr__(self, name: str) -> EmulatedKernel:
        kernels = self.__dict__.get("_kernels", {})
        if name in kernels:
            return kernels[name]
        raise AttributeError(f"shader library has no kernel {name!r} (has {sorted(kernels)})")

    def __dir__(self):
        return sorted(self._kernels)


class MpsRuntime(EmulatedRuntime):
    name = "mps"
    accelerator = MpsAccelerator
    FAULTS = {
        "no_device": "torch.backends.mps.is_available() is False",
        "not_built": "torch is built without MPS (torch.backends.mps.is_built() is False)",
        "no_compile_shader": "this torch has no torch.mps.compile_shader",
        "shader_compile_error": "compile_shader raises, as when the Metal compiler rejects a source",
        "macos13": "macOS 13: no bfloat16 on MPS (is_macos_or_newer(14, 0) is False)",
        "no_fused_adam": "torch has no fused Adam kernel for mps",
    }

    def __init__(self, polls_to_complete: int = 1, **faults: Any):
        super().__init__(polls_to_complete=polls_to_complete, **faults)
        # emulated tensors are host tensors, so the device draws from the host's generator
        self.generator = torch.default_generator
        self.libraries: list[EmulatedShaderLibrary] = []
        #: torch's MPS pinning (one copy into the shared, CPU+GPU visible allocator), emulated
        self.shared_allocator = PinnedHost(self)

    def compile_shader(self, source: str) -> EmulatedShaderLibrary:
        self.record("compile_shader", source)
        if self.faults.shader_compile_error:
            raise RuntimeError("Failed to create metal library, error: (emulated) program source failed to compile")
        lib = EmulatedShaderLibrary(self, source)
        self.libraries.append(lib)
        return lib

    def install(self, patcher: Patcher) -> None:
        rt = self
        mps, backend = torch.mps, torch.backends.mps
        version = (13, 6) if self.faults.macos13 else (15, 1)

        def synchronize() -> None:
            rt.record("synchronize")
            rt.synchronize_all()

        def manual_seed(seed) -> None:
            rt.generator.manual_seed(int(seed))

        api = {
            "is_available": lambda: not (rt.faults.no_device or rt.faults.not_built),
            "device_count": lambda: 0 if (rt.faults.no_device or rt.faults.not_built) else 1,
            "synchronize": synchronize,
            "manual_seed": manual_seed,
            "seed": lambda: rt.generator.seed(),
            "get_rng_state": lambda device="mps": rt.generator.get_state(),
            "set_rng_state": lambda new_state, device="mps": rt.generator.set_state(new_state),
            "_get_default_mps_generator": lambda: rt.generator,
            "empty_cache": lambda: rt.memory.empty_cache(),
            "current_allocated_memory": lambda: rt.memory.allocated,
            "driver_allocated_memory": lambda: rt.memory.reserved,
            "recommended_max_memory": lambda: RECOMMENDED_MAX_MEMORY,
            "set_per_process_memory_fraction": lambda fraction: rt.record("set_per_process_memory_fraction", fraction),
            "Event": lambda enable_timing=False: EmulatedEvent(rt, enable_timing=enable_timing),
        }
        for name, fn in api.items():
            patcher.setattr(mps, name, fn)
        if self.faults.no_compile_shader:
            patcher.delattr(mps, "compile_shader")
        else:
            patcher.setattr(mps, "compile_shader", self.compile_shader)
        patcher.setattr(mps, EMULATED_MARKER, True)
        patcher.setattr(backend, "is_built", lambda: not rt.faults.not_built)
        patcher.setattr(backend, "is_available", lambda: not (rt.faults.no_device or rt.faults.not_built))
        patcher.setattr(backend, "is_macos_or_newer", lambda major, minor: version >= (major, minor))
        self.shared_allocator.install(patcher, "mps")

        from torch.utils import _foreach_utils

        real = _foreach_utils._get_fused_kernels_supported_devices

        def supported() -> list[str]:
            devices = [d for d in real() if d != "mps"]
            return devices if rt.faults.no_fused_adam else devices + ["mps"]

        patcher.setattr(_foreach_utils, "_get_fused_kernels_supported_devices", supported)

