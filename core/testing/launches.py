"""Count the kernels a piece of PyTorch code launches, at the dispatcher (device-independent).

A step bound by the host's launches (a MoE layer with few tokens a step) costs about its
number of launches; counting them on the CPU shows what a change saves before any GPU runs it.
:class:`Launches` counts the aten ops that launch a kernel (views, metadata and bare
allocations launch none) and, apart, the Triton kernel launches (under ``TRITON_INTERPRET=1``
the interpreter's, whose own tensor traffic is not counted as aten ops).
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops that launch no kernel (views, metadata, allocation without a fill)
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "t", "transpose", "as_strided", "detach", "alias", "expand", "slice", "select", "split",
    "split_with_sizes", "permute", "unsqueeze", "squeeze", "_reshape_alias", "unbind", "empty", "empty_strided",
    "new_empty", "new_empty_strided", "empty_like", "lift_fresh",
})


class Launches(TorchDispatchMode):
    """Within: ``ops`` counts the aten ops that launch a kernel by name, ``triton`` the Triton launches by kernel."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.triton: Counter = Counter()
        self._inside_triton = False
        self._restore = None

    @property
    def total(self) -> int:
        """Aten kernel launches counted (Triton's apart)."""
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL and not self._inside_triton:
            self.ops[name] += 1
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
