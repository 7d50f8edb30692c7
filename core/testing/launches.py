"""Count the kernels a piece of PyTorch code launches, at the dispatcher (device-independent).

A step bound by the host's launches (a MoE layer with few tokens a step) costs about its
number of launches; counting them on the CPU shows what a change saves before any GPU runs it.
:class:`Launches` counts the aten ops that launch a kernel (views, metadata and bare
allocations launch none) and, apart, the Triton kernel launches (under ``TRITON_INTERPRET=1``
the interpreter's, whose own tensor traffic is not counted as aten ops).

Apart again, ``syncs`` counts the ops that read device values back to the host, each of which waits
on an accelerator for everything queued before it: a step that has one loses the host's lead over
the device there. On the CPU they are the same ops as on a GPU (:data:`HOST_READS`, and
``repeat_interleave`` without ``output_size``), so a test on the CPU can assert a step has none.
Reads that dispatch nothing on the CPU (``.tolist()`` / ``.cpu()`` of a CPU tensor) are not seen.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops that launch no kernel (views, metadata, allocation without a fill)
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "t", "transpose", "as_strided", "detach", "alias", "expand", "slice", "select", "split",
    "split_with_sizes", "permute", "unsqueeze", "squeeze", "_reshape_alias", "unbind", "empty", "empty_strided",
    "new_empty", "new_empty_strided", "empty_like", "lift_fresh",
})

#: aten ops whose result size or value is read back to the host (a device sync on an accelerator): ``.item()``,
#: ``bool()`` / ``int()`` of a tensor (``_local_scalar_dense``), data-dependent output sizes, value comparisons
HOST_READS = frozenset({
    "_local_scalar_dense", "item", "nonzero", "nonzero_static_fallback", "masked_select", "unique", "_unique",
    "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive", "equal", "bincount",
    "_assert_async",
})


def reads_to_host(func, args, kwargs) -> bool:
    """Whether the aten call ``func(*args, **kwargs)`` waits for the device to read a value back."""
    name, kwargs = func.overloadpacket.__name__, kwargs or {}
    if name in HOST_READS:
        return True
    if name == "repeat_interleave":  # repeats given as a tensor: summed on the device unless output_size says
        return func._overloadname != "self_int" and kwargs.get("output_size") is None
    if name == "histc":  # a range not given (min == max) is read from the values
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return lo == hi
    if name == "_to_copy" and args:  # a copy down to the host (.cpu(), .to("cpu"), .tolist() of device values)
        return kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu" \
            and args[0].device.type != "cpu"
    if name == "copy_" and len(args) > 1:
        return args[0].device.type == "cpu" and getattr(args[1], "device", args[0].device).type != "cpu"
    return False


class Launches(TorchDispatchMode):
    """Within: ``ops`` counts the aten ops that launch a kernel by name, ``triton`` the Triton launches by kernel,
    ``syncs`` the ops that read device values back to the host, by name (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.triton: Counter = Counter()
        self._inside_triton = False
        self._restore = None

    @property
    def total(self) -> int:
        """Aten kernel launches counted (Triton's apart)."""
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside_triton:
            if name not in NO_KERNEL:
                self.ops[name] += 1
            if reads_to_host(func, args, kwargs):
                self.syncs[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._patch_triton()
        return super().__enter__()

    def __exit__(self, *exc):
        if self._restore is not None:
            self._restore()
            self._restore = None
        return super().__exit__(*exc)

    def _patch_triton(self) -> None:
        try:
            import triton.runtime.interpreter as interpreter
            import triton.runtime.jit as jit
        except ImportError:  # no Triton here: no Triton launches to count
            return
        patched = [(cls, cls.run) for cls in (jit.JITFunction, interpreter.InterpretedFunction)]
        for cls, real in patched:
            cls.run = self._counting(real)

        def restore():
            for cls, real in patched:
                cls.run = real

        self._restore = restore

    def _counting(self, real):
        """``real`` (a kernel's ``run``), counted as one launch, its own dispatches not counted."""

        def run(fn_self, *args, **kwargs):
            if kwargs.get("warmup"):
                return real(fn_self, *args, **kwargs)
            self.triton[fn_self.fn.__name__] += 1
            self._inside_triton = True
            try:
                return real(fn_self, *args, **kwargs)
            finally:
                self._inside_triton = False

        return run
