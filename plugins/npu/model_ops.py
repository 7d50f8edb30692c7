"""npu builders of ``rms_norm``, ``rope`` and ``swiglu``: torch_npu's fused ``npu_rms_norm``, ``npu_rotary_mul``
and ``npu_swiglu``.

Both vendor ops are autograd-aware (their backward kernels are RmsNormGrad and RotaryMulGrad), so
these functions only map the op's contract onto them:

* ``rms_norm``: ``npu_rms_norm(x, gamma, eps)`` with ``gamma = weight`` when it has x's dtype and
  no offset. The vendor op wants one dtype for x and gamma, so the ``(offset + weight)`` form and a
  weight of another dtype run it in fp32 on ``x.float()`` and ``offset + weight.float()`` (the
  16-bit ``1 + w`` would round the scale), cast back; no weight: a ones gamma. 1-D x gets a row
  dimension (the op takes 2-8 dimensions). fp64 goes to the reference (the op has no fp64).
* ``rope``: ``npu_rotary_mul`` on q and on k with cos/sin as ``[B or 1, 1, S, D]`` and
  ``rotary_mode="half"`` or ``"interleave"``. cos/sin of another dtype than q's, fp64, and head_dim
  of 896 or more (the kernel's limit) go to the reference.
* ``swiglu``: ``npu_swiglu`` over ``torch.cat([gate, up], -1)`` (the vendor op takes one tensor and halves
  it; the concatenation keeps autograd's gradients for gate and up separate). fp64 goes to the reference.
"""

from __future__ import annotations

import sys

import torch
from polyaccel.ops.reference.rms_norm import check_rms_norm_args
from polyaccel.ops.reference.rms_norm import rms_norm as reference_rms_norm
from polyaccel.ops.reference.rope import check_rope_args, heads_view
from polyaccel.ops.reference.rope import rope as reference_rope
from polyaccel.ops.reference.swiglu import check_swiglu_args
from polyaccel.ops.reference.swiglu import swiglu as reference_swiglu

VENDOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROTARY_MAX_D = 896


def _vendor():
    return sys.modules["torch_npu"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *, offset: float = 0.0) -> torch.Tensor:
    check_rms_norm_args(x, weight, eps, offset)
    if x.dtype not in VENDOR_DTYPES or (weight is not None and weight.dtype not in VENDOR_DTYPES):
        return reference_rms_norm(x, weight, eps, offset=offset)
    H = x.shape[-1]
    rows = x if x.dim() >= 2 else x.unsqueeze(0)
    if weight is None:
        y = _vendor().npu_rms_norm(rows, torch.ones(H, dtype=x.dtype, device=x.device), epsilon=eps)[0]
    elif offset == 0.0 and weight.dtype == x.dtype:
        y = _vendor().npu_rms_norm(rows, weight, epsilon=eps)[0]
    else:
        y = _vendor().npu_rms_norm(rows.float(), weight.float() + offset, epsilon=eps)[0].to(x.dtype)
    return y if x.dim() >= 2 else y.squeeze(0)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
         interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    check_rope_args(q, k, cos, sin, interleaved)
    if q.dtype not in VENDOR_DTYPES or cos.dtype != q.dtype or q.shape[-1] >= ROTARY_MAX_D:
        return reference_rope(q, k, cos, sin, interleaved=interleaved)
    c, s = heads_view(cos), heads_view(sin)
    mode = "interleave" if interleaved else "half"
    vendor = _vendor()
    return vendor.npu_rotary_mul(q, c, s, rotary_mode=mode), vendor.npu_rotary_mul(k, c, s, rotary_mode=mode)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    check_swiglu_args(gate, up)
    if gate.dtype not in VENDOR_DTYPES or gate.numel() == 0:
        return reference_swiglu(gate, up)
    return _vendor().npu_swiglu(torch.cat([gate, up], dim=-1), dim=-1)
