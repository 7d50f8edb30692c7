"""The parts of :mod:`polyaccel.integrations.deepspeed` that subclass DeepSpeed's classes, so they exist only
once DeepSpeed is imported: :func:`~polyaccel.integrations.deepspeed.install` (or the first use of one of
these names through that module) imports this module; importing the integration alone imports neither."""

from __future__ import annotations

import contextlib
import functools
import os

import polyaccel
import torch

from ._deepspeed_base import MAPPED_BUILDERS, CPUAdamOp, FusedAdamOp, FusedLionOp, import_deepspeed_quietly

import_deepspeed_quietly()  # binds DeepSpeed's own accelerator and builders first; install() rebinds them

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator  # noqa: E402
from deepspeed.ops.op_builder.builder import OpBuilder  # noqa: E402
from deepspeed.ops.op_builder.cpu.no_impl import (  # noqa: E402
    NotImplementedBuilder as _DSNotImplementedBuilder,
)

#: the public home of these classes (their reprs, DeepSpeed's logs and pickles name it)
PUBLIC_MODULE = "polyaccel.integrations.deepspeed"


# ------------------------------------------------------------------------------------------- builders
class _PolyaccelBuilder(OpBuilder):
    """An op DeepSpeed would compile, served by polyaccel's op registry instead: nothing to build."""

    BUILD_VAR = "DS_BUILD_POLYACCEL"
    NAME = "polyaccel"
    _op = None

    def __init__(self, name=None):
        super().__init__(name=name or self.NAME)

    def absolute_name(self):
        return f"polyaccel.integrations.deepspeed.{self.NAME}"

    def sources(self):
        return []

    def is_compatible(self, verbose=False):
        return True

    def load(self, verbose=False):
        return self._op

    def jit_load(self, verbose=False):
        return self._op


class FusedAdamBuilder(_PolyaccelBuilder):
    NAME = "fused_adam"
    _op = FusedAdamOp()


class FusedLionBuilder(_PolyaccelBuilder):
    NAME = "fused_lion"
    _op = FusedLionOp()


class CPUAdamBuilder(_PolyaccelBuilder):
    NAME = "cpu_adam"
    _op = CPUAdamOp()


class NotImplementedBuilder(_DSNotImplementedBuilder):
    """A DeepSpeed op polyaccel does not provide: incompatible, and ``load`` says so with the plugin's
    name."""

    op_name = "op"

    def is_compatible(self, verbose=False):
        return False

    def load(self, verbose=True):
        acc = polyaccel.get_accelerator()
        raise ValueError(
            f"DeepSpeed's {self.op_name} is not provided by polyaccel (accelerator plugin {acc.name!r}): "
            f"the polyaccel DeepSpeed integration maps {', '.join(MAPPED_BUILDERS)} onto polyaccel ops; "
            "choose an optimizer or feature that uses those, or run DeepSpeed without "
            "polyaccel.integrations.deepspeed")


@functools.cache
def _not_implemented(class_name: str) -> type:
    return type(class_name, (NotImplementedBuilder,), {"op_name": class_name, "__module__": PUBLIC_MODULE})


_BUILDERS = {"FusedAdamBuilder": FusedAdamBuilder, "FusedLionBuilder": FusedLionBuilder,
             "CPUAdamBuilder": CPUAdamBuilder}


# ------------------------------------------------------------------------------------------- accelerator
class PolyaccelDeepSpeedAccelerator(DeepSpeedAccelerator):
    """DeepSpeed's accelerator interface answered by a polyaccel accelerator (default: the selected one)."""

    _torch_pins_host_memory = False  # pinning goes through the polyaccel accelerator

    def __init__(self, accelerator=None):
        super().__init__()
        self.polyaccel = accelerator if accelerator is not None else polyaccel.get_accelerator()
        self._host = self.polyaccel.device(0).type == "cpu"  # host tensors (cpu, example, emulated runtimes)
        self._name = "cpu" if self._host else self.polyaccel.device_type
        from polyaccel.comm import resolve_hooks

        self._communication_backend_name = resolve_hooks(self.polyaccel).backend
        self._compile_backend = "inductor"

    def __repr__(self) -> str:
        return f"PolyaccelDeepSpeedAccelerator({self.polyaccel.name!r}, device type {self._name!r})"

    def _mod(self):
        return None if self._host else torch.get_device_module(self._name)

    # execution model
    def is_synchronized_device(self):
        return self.polyaccel.is_synchronized_device()

    def use_host_timers(self):
        return self.polyaccel.use_host_timers()

    def resolves_data_dependency(self):
        return self.polyaccel.resolves_data_dependency()

    def handles_memory_backpressure(self):
        return self.polyaccel.handles_memory_backpressure()

    # device
    def device_name(self, device_index=None):
        if self._host or device_index is None:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index=None):
        mod = self._mod()
        return None if mod is None or not hasattr(mod, "device") else mod.device(device_index)

    def set_device(self, device_index):
        if not self._host:
            self.polyaccel.set_device(self._index(device_index))

    def _index(self, device) -> int:
        """The device index DeepSpeed means: it passes ints, strings ("cuda:1") and ``torch.device`` objects
        (ZeRO-3's ``Init`` passes its ``local_device``), as ``torch.cuda.set_device`` takes them all."""
        if isinstance(device, (str, torch.device)):
            dev = torch.device(device)
            if dev.type != self._name:
                raise ValueError(f"set_device({device!r}): this accelerator's devices are {self._name!r}")
            return dev.index if dev.index is not None else self.polyaccel.current_device()
        return int(device)

    def current_device(self):
        if self._host:
            return int(os.environ.get("LOCAL_RANK", 0))
        return self.polyaccel.current_device()

    def current_device_name(self):
        return self._name if self._host else f"{self._name}:{self.current_device()}"

    def device_count(self):
        return self.polyaccel.device_count()

    def synchronize(self, device_index=None):
        return self.polyaccel.synchronize(device_index)

    # RNG (the host's generator is torch's default one)
    def random(self):
        return torch.random

    def set_rng_state(self, new_state, device_index=None):
        if self._host:
            return torch.set_rng_state(new_state)
        return self.polyaccel.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index=None):
        return torch.get_rng_state() if self._host else self.polyaccel.get_rng_state(device_index)

    def manual_seed(self, seed):
        return torch.manual_seed(seed) if self._host else self.polyaccel.manual_seed(seed)

    def manual_seed_all(self, seed):
        return torch.manual_seed(seed) if self._host else self.polyaccel.manual_seed_all(seed)

    def initial_seed(self):
        return torch.initial_seed() if self._host else self.polyaccel.initial_seed()

    def default_generator(self, device_index):
        if self._host:
            return torch.default_generator
        return self._mod().default_generators[device_index]

    # streams and events: the plugin's when it claims them; none on a synchronized device
    @property
    def Stream(self):
        return self.polyaccel.Stream if self.polyaccel.has("streams") else None

    def stream(self, stream):
        if stream is None or not self.polyaccel.has("streams"):
            return contextlib.nullcontext()
        return self.polyaccel.stream(stream)

    def current_stream(self, device_index=None):
        return self.polyaccel.current_stream(device_index) if self.polyaccel.has("streams") else None

    def default_stream(self, device_index=None):
        return self.polyaccel.default_stream(device_index) if self.polyaccel.has("streams") else None

    @property
    def Event(self):
        return self.polyaccel.Event if self.polyaccel.has("events") else None

    # memory
    def _stat(self, name, *args):
        if self.polyaccel.has("memory_stats"):
            return getattr(self.polyaccel, name)(*args)
        return 0 if name != "memory_stats" else {}

    def empty_cache(self):
        return self.polyaccel.empty_cache()

    def memory_allocated(self, device_index=None):
        return self._stat("memory_allocated", device_index)

    def max_memory_allocated(self, device_index=None):
        return self._stat("max_memory_allocated", device_index)

    def reset_max_memory_allocated(self, device_index=None):
        if self.polyaccel.has("memory_stats"):
            self.polyaccel.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index=None):
        return self._stat("memory_reserved", device_index)

    def max_memory_cached(self, device_index=None):
        return self._stat("memory_reserved", device_index)

    def reset_max_memory_cached(self, device_index=None):
        self.reset_max_memory_allocated(device_index)

    def memory_stats(self, device_index=None):
        return self._stat("memory_stats", device_index)

    def reset_peak_memory_stats(self, device_index=None):
        self.reset_max_memory_allocated(device_index)

    def memory_reserved(self, device_index=None):
        return self._stat("memory_reserved", device_index)

    def max_memory_reserved(self, device_index=None):
        return self._stat("memory_reserved", device_index)

    def total_memory(self, device_index=None):
        if self.polyaccel.has("memory_stats"):
            return self.polyaccel.total_memory(device_index)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None):
        if self.polyaccel.has("memory_stats"):
            return self.polyaccel.available_memory(device_index)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # dtypes
    def is_bf16_supported(self):
        return self.polyaccel.is_bf16_supported()

    def is_fp16_supported(self):
        return self.polyaccel.is_fp16_supported()

    def is_fp64_supported(self):
        return self.polyaccel.has("fp64") or self._host

    def supported_dtypes(self):
        return list(self.polyaccel.supported_dtypes())

    # misc
    def is_available(self):
        return bool(self.polyaccel.probe().available)

    def range_push(self, msg, domain=None, category=None):
        return None

    def range_pop(self, domain=None):
        return None

    def lazy_call(self, callback):
        mod = self._mod()
        if mod is not None and hasattr(mod, "_lazy_call"):
            return mod._lazy_call(callback)
        return callback()

    def communication_backend_name(self):
        return self._communication_backend_name

    def is_triton_supported(self):
        return bool(self.polyaccel.is_triton_supported())

    # graphs: the plugin's; Unsupported where it has none (no silent no-op replay)
    def create_graph(self):
        return self.polyaccel.create_graph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return self.polyaccel.capture_to_graph(graph, pool=pool, stream=stream)

    def replay_graph(self, graph):
        return self.polyaccel.replay_graph(graph)

    # tensor constructors on this accelerator
    def _tensor(self, dtype):
        return functools.partial(torch.tensor, dtype=dtype, device=self.current_device_name())

    @property
    def BFloat16Tensor(self):
        return self._tensor(torch.bfloat16)

    @property
    def ByteTensor(self):
        return self._tensor(torch.uint8)

    @property
    def DoubleTensor(self):
        return self._tensor(torch.float64)

    @property
    def FloatTensor(self):
        return self._tensor(torch.float32)

    @property
    def HalfTensor(self):
        return self._tensor(torch.float16)

    @property
    def IntTensor(self):
        return self._tensor(torch.int32)

    @property
    def LongTensor(self):
        return self._tensor(torch.int64)

    # pinned host memory through the plugin
    def _nothing_to_pin(self) -> bool:
        """A host device (cpu, example, an emulated runtime) computes on host memory: there is no DMA for
        page-locked memory to speed up. Where such a plugin does not claim ``pinned``, DeepSpeed's offload
        buffers (ZeRO-3's gradient buffers, ``offload_optimizer``) stay ordinary host tensors, as DeepSpeed's
        own CPU accelerator keeps them, instead of failing on the plugin's ``Unsupported``. A device plugin's
        pinning is always its own."""
        return self._host and not self.polyaccel.has("pinned")

    def _torch_pin_memory(self, tensor):
        if self._nothing_to_pin():
            return tensor
        return self.polyaccel.pin_memory(tensor)

    def _torch_empty_pinned(self, tensor, shape):
        if self._nothing_to_pin():
            return tensor.new_empty(tuple(shape))
        return self.polyaccel.empty_pinned(tuple(shape), tensor.dtype)

    def _torch_is_pinned(self, tensor):
        if self._nothing_to_pin():
            return tensor.is_pinned()
        return self.polyaccel.is_pinned(tensor)

    def pin_memory_alignment(self):
        return self.polyaccel.pin_memory_alignment()

    def on_accelerator(self, tensor):
        return tensor.device.type == self._name

    # op builders
    def op_builder_dir(self):
        # DeepSpeed lists builder names from this package (op_builder.all_ops), asks get_op_builder for each
        return "deepspeed.ops.op_builder"

    def create_op_builder(self, class_name):
        builder = self.get_op_builder(class_name)
        return None if builder is None else builder()

    def get_op_builder(self, class_name):
        return _BUILDERS.get(class_name) or _not_implemented(class_name)

    def build_extension(self):
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    def export_envs(self):
        return []

    def visible_devices_envs(self):
        return list(self.polyaccel.visible_devices_envs())

    def set_visible_devices_envs(self, current_env, local_accelerator_ids):
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self):
        return self._compile_backend

    def set_compile_backend(self, backend):
        self._compile_backend = backend


for _cls in (FusedAdamBuilder, FusedLionBuilder, CPUAdamBuilder, NotImplementedBuilder,
             PolyaccelDeepSpeedAccelerator):
    _cls.__module__ = PUBLIC_MODULE
