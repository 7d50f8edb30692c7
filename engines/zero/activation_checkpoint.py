"""Activation checkpointing, optionally with the checkpointed inputs kept in host memory.

``checkpoint(fn, *args)`` runs ``fn`` keeping none of its intermediate activations: every tensor
autograd would save inside it is replaced by a handle, and the first time backward needs one,
``fn`` is run again from its inputs (same RNG state, same autocast state) and the handles are
answered from that recomputation (the non-reentrant scheme: gradients flow to the inputs
through the original graph, so ``torch.autograd.grad``, hooks and ``requires_grad`` inputs
behave as without checkpointing).

With ``cpu_checkpointing`` the inputs themselves leave the device as well: they are copied
asynchronously, in their own dtype, into host buffers from the accelerator contract (pinned
where the plugin claims ``pinned``), and copied back on a side stream (where the plugin claims
``streams``) while the backward of the next checkpoint is still running, so they are on the
device again when the recomputation needs them. The device copy of an input is then held by
nobody once the caller drops it. Host buffers are reused from step to step.

The DeepSpeed configuration section ``activation_checkpointing`` selects this. For a model with
Hugging Face's checkpointing switch (``gradient_checkpointing`` attributes on its layers) the
engine installs :func:`checkpoint` there; any other model calls ``engine.checkpoint(fn, *args)``.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from polyaccel.config_check import Bool, Int, Section
from polyaccel.errors import ConfigError

_KEYS = {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints",
         "synchronize_checkpoint_boundary", "profile"}
_REFUSED = {
    "partition_activations": "splitting checkpoints over tensor-parallel ranks is not implemented",
    "contiguous_memory_optimization": "a preallocated contiguous checkpoint buffer is not implemented",
    "profile": "per-checkpoint timing is not implemented; use benchmarks/zero_profile.py",
}


@dataclass(frozen=True)
class ActivationCheckpointConfig:
    enabled: bool = False
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    number_checkpoints: int | None = None  # as in DeepSpeed, only sizes the contiguous buffer


def parse_activation_checkpointing(section) -> ActivationCheckpointConfig:
    """Validate the ``activation_checkpointing`` section (None: off)."""
    if section is None:
        return ActivationCheckpointConfig()
    sec = Section(section, "activation_checkpointing", _KEYS)
    flags = {key: sec.get(key, Bool(), False) for key in sorted(_KEYS - {"number_checkpoints"})}
    for key, why in _REFUSED.items():
        if flags[key]:
            raise sec.error(key, f"is true, but {why}; set it to false")
    number = sec.get("number_checkpoints", Int(1, optional=True))
    return ActivationCheckpointConfig(True, flags["cpu_checkpointing"],
                                      flags["synchronize_checkpoint_boundary"], number)


class HostInputs:
    """Copies of checkpoint inputs in host memory, and their way back to the device."""

    def __init__(self, accelerator, host_buffers):
        self.accelerator = accelerator
        self.host = host_buffers
        self.crosses = accelerator.device().type != "cpu"
        self.side = accelerator.Stream() if self.crosses and accelerator.has("streams") else None
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def down(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying ``t`` into a host buffer (in ``t``'s dtype: no conversion inside the copy)."""
        pool = self._free.get((t.numel(), t.dtype))
        buf = pool.pop() if pool else self.host.empty(t.numel(), t.dtype)
        buf.copy_(t.detach().reshape(-1), non_blocking=self.crosses)
        return buf

    def up(self, buf: torch.Tensor, like: tuple) -> tuple[torch.Tensor, object]:
        """Start copying ``buf`` back to the device as a tensor ``like`` (shape, dtype, device), on the side
        stream when there is one; returns it and the stream the compute stream must wait for (or None)."""
        shape, dtype, device = like
        dev = torch.empty(shape, dtype=dtype, device=device)
        if self.side is None:
            dev.view(-1).copy_(buf, non_blocking=self.crosses)
            return dev, None
        self.side.wait_stream(self.accelerator.current_stream())  # the copy down has landed in stream order
        with self.accelerator.stream(self.side):
            dev.view(-1).copy_(buf, non_blocking=True)
        return dev, self.side

    def release(self, buf: torch.Tensor) -> None:
        """``buf`` may be reused: its copy up is ordered before any later copy down (see :meth:`_Frame.inputs`)."""
        self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)


class _Frame:
    """One checkpointed call: its inputs, its RNG and autocast state, and the recomputed saved tensors."""

    def __init__(self, fn, args, kwargs, device, offload: HostInputs | None):
        self.fn, self.kwargs, self.device, self.offload = fn, kwargs, device, offload
        self.args = []
        for a in args:
            if isinstance(a, torch.Tensor) and offload is not None:
                self.args.append(("host", offload.down(a), (a.shape, a.dtype, a.device), a.requires_grad))
            elif isinstance(a, torch.Tensor):
                self.args.append(("kept", a.detach(), None, a.requires_grad))
            else:
                self.args.append(("value", a, None, False))
        self.cpu_rng = torch.get_rng_state()
        self.device_rng = None
        if device.type != "cpu" and hasattr(torch, device.type):
            self.device_rng = getattr(torch, device.type).get_rng_state()
        self.autocast = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                         for t in {device.type, "cpu"}]
        self.saved: list[torch.Tensor | None] | None = None
        self.unused = 0
        self.recomputed = False
        self.prefetched = None
        self.previous = None  # weak reference to the checkpoint that ran before this one in forward

    def prefetch(self) -> None:
        if self.offload is None or self.prefetched is not None or self.recomputed:
            return
        self.prefetched = [self.offload.up(buf, like) if kind == "host" else None
                           for kind, buf, like, _ in self.args]

    def inputs(self) -> list:
        self.prefetch()
        out = []
        for (kind, value, _like, requires_grad), fetched in zip(self.args, self.prefetched or [None] * len(self.args),
                                                                strict=True):
            if kind == "host":
                dev, stream = fetched
                if stream is not None:
                    self.offload.accelerator.current_stream().wait_stream(stream)
                self.offload.release(value)
                out.append(dev.requires_grad_(requires_grad))
            elif kind == "kept":
                out.append(value.detach().requires_grad_(requires_grad))
            else:
                out.append(value)
        return out

    def recompute(self) -> None:
        previous = self.previous() if self.previous is not None else None
        if previous is not None:  # its inputs travel up while this recomputation and backward run
            previous.prefetch()
        args = self.inputs()
        saved: list[torch.Tensor] = []

        def keep(t):
            # detached, and the recomputed graph keeps nothing: a pack hook that returned ``t`` itself would,
            # for a tensor its own node saves (an output), close a reference cycle through autograd that only a
            # garbage collection breaks, keeping every recomputed activation until then
            saved.append(t.detach())

        devices = [self.device.index or 0] if self.device_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu_rng)
            if self.device_rng is not None:
                getattr(torch, self.device.type).set_rng_state(self.device_rng)
            with contextlib.ExitStack() as stack:
                for device_type, enabled, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(keep, lambda _: None))
                self.fn(*args, **self.kwargs)
        self.saved = saved
        self.unused = len(saved)
        self.recomputed = True
        self.args = []

    def take(self, index: int) -> torch.Tensor:
        """Hand out a recomputed tensor and let go of it: backward unpacks each saved tensor once, and holding
        them until the whole graph dies would keep every checkpoint's recomputed activations at once."""
        if self.saved is None or self.saved[index] is None:
            raise RuntimeError("backward went through a checkpointed region a second time (retain_graph=True); "
                               "polyaccel's activation checkpointing recomputes once per forward: run forward again")
        t = self.saved[index]
        self.saved[index] = None
        self.unused -= 1
        if not self.unused:
            self.saved = None
        return t


class ActivationCheckpointer:
    """The engine's checkpoint function, configured once (see the module docstring)."""

    def __init__(self, config: ActivationCheckpointConfig, accelerator, host_buffers):
        self.config = config
        self.accelerator = accelerator
        self.device = accelerator.device()
        self.offload = HostInputs(accelerator, host_buffers) if config.cpu_checkpointing else None
        self._last = None  # weak reference: frames live exactly as long as the graph that may recompute them
        self.checkpoints = 0  # calls that checkpointed (for a quick check that a model really uses it)

    def __call__(self, fn, *args, use_reentrant: bool | None = None, **kwargs):
        if use_reentrant:
            raise ConfigError("use_reentrant=True: polyaccel's activation checkpointing is non-reentrant; pass "
                              "use_reentrant=False or leave it out")
        if not torch.is_grad_enabled():  # nothing will be saved, nothing recomputed
            return fn(*args, **kwargs)
        self.checkpoints += 1
        frame = _Frame(fn, args, kwargs, self.device, self.offload)
        last = self._last() if self._last is not None else None
        if last is not None and not last.recomputed:
            frame.previous = self._last
        self._last = weakref.ref(frame)
        count = 0

        def pack(t):
            nonlocal count
            count += 1
            return count - 1

        def unpack(index):
            if not frame.recomputed:
                frame.recompute()
            return frame.take(index)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = fn(*args, **kwargs)
        if self.config.synchronize_checkpoint_boundary:
            self.accelerator.synchronize()
        return out

    def install(self, model: torch.nn.Module) -> int:
        """Use this checkpoint function in a model with Hugging Face's switch; returns how many modules took it."""
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            return 0
        taken = 0
        for module in model.modules():
            if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
                module._gradient_checkpointing_func = self
                taken += 1
        return taken
