"""npu op builders.

* ``fused_adam``: torch's fused Adam/AdamW interface (``torch._fused_adam_`` /
  ``torch._fused_adamw_``), which torch_npu implements for npu tensors; the deprecated
  per-tensor ``torch_npu.npu_apply_adam*`` ops are not used. Lists mixing dtypes (16-bit
  params with fp32 states) or ``bias_correction=False`` take a foreach path with fp32 math.
* ``fused_lion`` / ``fused_lamb``: ``torch._foreach_*`` ops (one launch per op over the
  whole list, served by torch_npu's foreach kernels), fp32 math.
* ``quantize`` (int8/int4, symmetric and asymmetric): group scales computed with torch,
  rounding and saturation by ``torch_npu.npu_quantize``; fp8 goes to the reference. A group
  holding a NaN or an infinity gets the contract's NaN scale (zero point 0, codes 0).
* ``rms_norm`` / ``rope`` / ``swiglu``: torch_npu's fused ``npu_rms_norm``, ``npu_rotary_mul`` and
  ``npu_swiglu`` (:mod:`.model_ops`).
"""

from __future__ import annotations

import sys

import torch
from polyaccel.ops import OpBuilder, torch_optim
from polyaccel.ops.reference.quantize import QuantizedTensor, check_quantize_args, pack_int4, qmax
from polyaccel.ops.reference.quantize import quantize as reference_quantize

HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------- compatibility
def _npu_accelerator(acc) -> tuple[bool, str]:
    if acc is None or acc.name != "npu":
        return False, "needs the npu accelerator (torch_npu on an Ascend host)"
    return True, ""


def _fused_adam_compatible(acc) -> tuple[bool, str]:
    ok, why = _npu_accelerator(acc)
    return torch_optim.fused_kernel_support("npu") if ok else (ok, why)


def _quantize_compatible(acc) -> tuple[bool, str]:
    ok, why = _npu_accelerator(acc)
    if not ok:
        return ok, why
    if not hasattr(sys.modules.get("torch_npu"), "npu_quantize"):
        return False, "this torch_npu has no npu_quantize"
    return True, ""


def _vendor_op_compatible(name: str):
    def compatible(acc) -> tuple[bool, str]:
        ok, why = _npu_accelerator(acc)
        if not ok:
            return ok, why
        if not hasattr(sys.modules.get("torch_npu"), name):
            return False, f"this torch_npu has no {name}"
        return True, ""

    return compatible


def _model_op(name: str):
    def load():
        from . import model_ops

        return getattr(model_ops, name)

    return load


# --------------------------------------------------------------------- quantize
def quantize(x, mode="int8", group_size=128, symmetric=True):
    check_quantize_args(x, mode, group_size, symmetric)
    if mode == "fp8":
        return reference_quantize(x, mode, group_size, symmetric)
    torch_npu = sys.modules["torch_npu"]
    groups = x.reshape(-1, group_size).float()
    # a group holding a NaN or an infinity is quantized as zeros and gets a NaN scale (the op's contract)
    bad = ~torch.isfinite(groups).all(dim=1)
    groups = torch.where(bad[:, None], torch.zeros_like(groups), groups)
    top = qmax(mode, symmetric)
    if symmetric:
        amax = groups.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
        zero = None
        out_dtype = torch.qint8
    else:
        lo = groups.amin(dim=1).clamp(max=0)
        hi = groups.amax(dim=1).clamp(min=0)
        span = hi - lo
        scale = torch.where(span > 0, span / top, torch.ones_like(span))
        zero = torch.round(-lo / scale).clamp(0, top)
        out_dtype = torch.quint8
    # npu_quantize broadcasts scales along the last axis only: put the groups there
    q = torch_npu.npu_quantize(groups.t().contiguous(), scale,
                               None if zero is None else zero.to(torch.int32), out_dtype, -1, True)
    if q.dtype in (torch.qint8, torch.quint8):
        q = q.int_repr()
    q = q.t().reshape(-1).to(torch.int16)
    q = q.clamp(-top, top) if symmetric else q.clamp(0, top)
    if mode == "int4":
        data = pack_int4(q)
    else:
        data = q.to(torch.int8 if symmetric else torch.uint8)
    zp = None if zero is None else zero.to(torch.uint8)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    return QuantizedTensor(data, scale, zp, mode, group_size, x.shape, x.dtype)


def builders() -> list[OpBuilder]:
    return [
        OpBuilder(op="fused_adam", name="npu_torch_fused_adam", device_types=("npu",),
                  loader=lambda: torch_optim.fused_adam, kind="torch", priority=50, compatible=_fused_adam_compatible,
                  description="torch._fused_adam(w)_ on npu (torch_npu kernel); foreach fp32 for mixed dtypes"),
        *torch_optim.foreach_builders("npu", compatible=_npu_accelerator),
        OpBuilder(op="quantize", name="npu_quantize", device_types=("npu",), loader=lambda: quantize, kind="vendor",
                  priority=50, compatible=_quantize_compatible,
                  description="group scales in torch, rounding/saturation by torch_npu.npu_quantize (fp8: reference)"),
        OpBuilder(op="rms_norm", name="npu_rms_norm", device_types=("npu",), loader=_model_op("rms_norm"),
                  kind="vendor", priority=50, compatible=_vendor_op_compatible("npu_rms_norm"),
                  description="torch_npu.npu_rms_norm (fused, autograd via RmsNormGrad); the (1 + w) form and "
                              "mixed dtypes in fp32, fp64 to the reference"),
        OpBuilder(op="rope", name="npu_rotary_mul", device_types=("npu",), loader=_model_op("rope"), kind="vendor",
                  priority=50, compatible=_vendor_op_compatible("npu_rotary_mul"),
                  description="torch_npu.npu_rotary_mul on q and on k (half / interleave, autograd via "
                              "RotaryMulGrad); cos/sin of another dtype, fp64 or head_dim >= 896 to the reference"),
        OpBuilder(op="swiglu", name="npu_swiglu", device_types=("npu",), loader=_model_op("swiglu"), kind="vendor",
                  priority=50, compatible=_vendor_op_compatible("npu_swiglu"),
                  description="torch_npu.npu_swiglu over [gate | up] (autograd via SwiGluGrad); fp64 to the "
                              "reference"),
    ]
