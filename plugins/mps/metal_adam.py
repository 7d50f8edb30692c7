"""FusedAdam as a Metal compute kernel, compiled at run time with ``torch.mps.compile_shader``.

One library per (param dtype, state dtype) pair is compiled on first use and cached;
one thread updates one element with fp32 math, reading and writing params/grads in
their own dtype and the moments in theirs (fp32 moments for 16-bit params, the usual
mixed-precision layout). Scalars reach the kernel as torch passes them: a Python float
binds to ``constant float&`` and a Python int to ``constant long&`` (64-bit).

The kernel runs only on a real MPS device; under the plugin's emulated runtime
(:mod:`.emulation`) the same source is compiled for the host and run
element by element (see docs/backends.md for what that does and does not prove).
"""

from __future__ import annotations

import math
import string
import threading

import torch
from polyaccel.ops.reference import optimizers as ref

#: torch dtype -> Metal scalar type
METAL_TYPES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}

#: the (param, state) dtype pairs with a kernel; anything else takes the torch path
KERNEL_DTYPES = (
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
)

#: one dispatch covers at most this many elements (the grid index is a 32-bit uint)
MAX_THREADS_PER_DISPATCH = 2**31

SOURCE_TEMPLATE = string.Template(r"""
#include <metal_stdlib>
using namespace metal;

// Adam / AdamW step for one element; P = param and grad type, S = moment type, math in float.
kernel void $name(device $P* param,
                  device const $P* grad,
                  device $S* exp_avg,
                  device $S* exp_avg_sq,
                  constant float& lr,
                  constant float& beta1,
                  constant float& beta2,
                  constant float& eps,
                  constant float& weight_decay,
                  constant float& bias_correction1,
                  constant float& bias_correction2_sqrt,
                  constant long& adam_w_mode,
                  constant long& numel,
                  uint idx [[thread_position_in_grid]]) {
    if (static_cast<long>(idx) >= numel) {
        return;
    }
    float p = static_cast<float>(param[idx]);
    float g = static_cast<float>(grad[idx]);
    float m = static_cast<float>(exp_avg[idx]);
    float v = static_cast<float>(exp_avg_sq[idx]);
    if (adam_w_mode != 0) {
        p = p * (1.0f - lr * weight_decay);
    } else {
        g = g + weight_decay * p;
    }
    m = beta1 * m + (1.0f - beta1) * g;
    v = beta2 * v + (1.0f - beta2) * g * g;
    float denom = sqrt(v) / bias_correction2_sqrt + eps;
    p = p - (lr / bias_correction1) * (m / denom);
    param[idx] = static_cast<$P>(p);
    exp_avg[idx] = static_cast<$S>(m);
    exp_avg_sq[idx] = static_cast<$S>(v);
}
""")


def kernel_name(param_dtype: torch.dtype, state_dtype: torch.dtype) -> str:
    return f"polyaccel_fused_adam_{METAL_TYPES[param_dtype]}_{METAL_TYPES[state_dtype]}"


def kernel_source(param_dtype: torch.dtype, state_dtype: torch.dtype) -> str:
    """The Metal source of the kernel for one (param, state) dtype pair."""
    return SOURCE_TEMPLATE.substitute(name=kernel_name(param_dtype, state_dtype), P=METAL_TYPES[param_dtype],
                                      S=METAL_TYPES[state_dtype])


class MetalFusedAdam:
    """The op callable: compiles kernels lazily, dispatches one per tensor (chunked if huge).

    Calls whose tensors have no kernel (another dtype pair, non-contiguous tensors, a source
    the Metal compiler rejected) go to ``fallback`` (torch's fused Adam) as a whole, so one
    call never mixes implementations.
    """

    def __init__(self, fallback):
        self._fallback = fallback
        self._libraries: dict[tuple[torch.dtype, torch.dtype], object] = {}
        #: (param, state) dtype pairs whose source the Metal compiler rejected, with its message
        self.compile_errors: dict[tuple[torch.dtype, torch.dtype], str] = {}
        self._lock = threading.Lock()
        self.dispatches = 0
        self.fallback_calls = 0

    def kernel(self, param_dtype: torch.dtype, state_dtype: torch.dtype):
        """The compiled kernel for a dtype pair, or None if the Metal compiler rejected it (e.g. ``bfloat``
        before macOS 14); the rejection is kept in :attr:`compile_errors` and that pair takes the fallback."""
        key = (param_dtype, state_dtype)
        with self._lock:
            if key in self.compile_errors:
                return None
            lib = self._libraries.get(key)
            if lib is None:
                try:
                    lib = torch.mps.compile_shader(kernel_source(param_dtype, state_dtype))
                except RuntimeError as exc:
                    self.compile_errors[key] = str(exc)
                    return None
                self._libraries[key] = lib
        return getattr(lib, kernel_name(param_dtype, state_dtype))

    def _has_kernel(self, p, g, m, v) -> bool:
        return ((p.dtype, m.dtype) in KERNEL_DTYPES and g.dtype == p.dtype and v.dtype == m.dtype
                and all(t.is_contiguous() for t in (p, g, m, v)) and self.kernel(p.dtype, m.dtype) is not None)

    def __call__(self, params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                 adam_w_mode=True, bias_correction=True):
        ref.check_lists("fused_adam", params, grads, exp_avgs, exp_avg_sqs)
        quads = [q for q in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True) if q[0].numel()]
        if not quads:
            return
        if not all(self._has_kernel(*q) for q in quads):
            self.fallback_calls += 1
            self._fallback(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, step=step, adam_w_mode=adam_w_mode,
                           bias_correction=bias_correction)
            return
        s = float(step.item()) if isinstance(step, torch.Tensor) else float(step)
        bc1 = 1.0 - beta1**s if bias_correction else 1.0
        bc2_sqrt = math.sqrt(1.0 - beta2**s) if bias_correction else 1.0
        scalars = (float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), float(bc1),
                   float(bc2_sqrt), int(bool(adam_w_mode)))
        for p, g, m, v in quads:
            fn = self.kernel(p.dtype, m.dtype)
            flat = [t.view(-1) for t in (p, g, m, v)]
            n = flat[0].numel()
            for start in range(0, n, MAX_THREADS_PER_DISPATCH):
                count = min(MAX_THREADS_PER_DISPATCH, n - start)
                chunk = [t[start:start + count] for t in flat] if count != n else flat
                fn(*chunk, *scalars, count, threads=count)
                self.dispatches += 1
