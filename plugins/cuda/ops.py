"""Op builders of the cuda plugin (device type "cuda"), in one table.

Triton kernels for the multi-tensor optimizers (fused_adam, fused_lion, fused_lamb) above
torch's fused Adam, and for quantize/dequantize, swiglu, weighted_swiglu, grouped_mm (also
torch._grouped_mm), gather_sum, rms_norm, rope and the fused expert MLP (moe_gate_up, moe_down_combine:
torch._grouped_mm and the Triton passes in one autograd node per op; docs/autoep.md tells why the
all-Triton fused kernels were taken out); the loss ops: linear_cross_entropy (core's chunked loop
with Triton chunk kernels, cuBLAS GEMMs), logprobs, entropy and kl. The plugin's
``polyaccel_op_builders`` hook returns :func:`builders`.

Importing this module loads neither Triton nor a kernel: a loader imports its kernel module on
first use, and the ``compatible`` checks are cheap questions about the accelerator serving
"cuda". Triton builders are compatible only where :func:`triton_support.triton_compatible` says
so; ``polyaccel.ops.explain("fused_adam", "cuda")`` shows the reason when they are not.

fp8: the ``quantize`` / ``dequantize`` builders serve every mode. fp8 (e4m3) needs compute
capability 8.9 or newer for Triton's conversions; on an older GPU the builder stays chosen
for int8/int4 and an fp8 call raises ``polyaccel.Unsupported`` naming the cuda plugin (with the
override to the reference in its hint). :func:`fp8_compatible` answers the same question up
front, for capability reports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from polyaccel.ops import OpBuilder, torch_optim

from .triton_support import triton_compatible

#: compute capability from which Triton converts to and from e4m3
FP8_MIN_CAPABILITY = (8, 9)
#: compute capability torch._grouped_mm's CUTLASS kernels are built for
GROUPED_MM_MIN_CAPABILITY = (9, 0)

#: the Triton multi-tensor optimizers rank above torch's fused Adam
TRITON_OPTIMIZER_PRIORITY = 100
TORCH_FUSED_ADAM_PRIORITY = 50
#: the other Triton kernels; torch._grouped_mm ranks above Triton's grouped_mm where it runs
TRITON_KERNEL_PRIORITY = 50
TORCH_GROUPED_MM_PRIORITY = 60
#: the expert ops as torch._grouped_mm and the Triton passes in one autograd node per op: the unfused chain's
#: kernels with a third of its autograd nodes (2 against 6), so chosen by default where torch._grouped_mm runs
TORCH_MOE_PRIORITY = 60

#: torch's fused CUDA Adam/AdamW kernel per dtype group; foreach where its preconditions do not hold
torch_fused_adam = torch_optim.fused_adam


# ----------------------------------------------------------------------------- compatibility
def _torch_cuda_compatible(accelerator) -> tuple[bool, str]:
    if accelerator is None or accelerator.device_type != "cuda":
        return False, "no usable CUDA/ROCm accelerator serves device type 'cuda' here"
    if not hasattr(torch, "_fused_adamw_"):
        return False, f"torch {torch.__version__} has no fused Adam kernel"
    return True, ""


def _capability(accelerator) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(accelerator.current_device()))


def fp8_compatible(accelerator) -> tuple[bool, str]:
    """(ok, reason) for fp8 (e4m3) quantize/dequantize through the Triton builder."""
    ok, why = triton_compatible(accelerator)
    if not ok:
        return False, why
    if getattr(torch.version, "hip", None):
        dtypes = accelerator.fp8_dtypes() if hasattr(accelerator, "fp8_dtypes") else ()
        if torch.float8_e4m3fn not in dtypes:
            return False, f"the kernels write float8_e4m3fn; this GPU's fp8 formats are {list(map(str, dtypes))}"
        return True, ""
    cap = _capability(accelerator)
    if cap < FP8_MIN_CAPABILITY:
        return False, (f"compute capability {cap[0]}.{cap[1]} has no e4m3 conversions "
                       f"(needs {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+); int8 and int4 still run")
    return True, ""


def torch_moe_compatible(accelerator) -> tuple[bool, str]:
    """(ok, reason) for the ``torch_moe_*`` builders: ``torch._grouped_mm`` and the Triton passes both run."""
    ok, why = torch_grouped_mm_compatible(accelerator)
    return (ok, why) if not ok else triton_compatible(accelerator)


def torch_grouped_mm_compatible(accelerator) -> tuple[bool, str]:
    """(ok, reason) for the ``torch._grouped_mm`` builder."""
    if accelerator is None:
        return False, "no usable accelerator serves this device type (no CUDA GPU here)"
    if accelerator.device_type != "cuda":
        return False, f"{accelerator.name} uses device type {accelerator.device_type!r}, not 'cuda'"
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm (added in torch 2.8)"
    if getattr(torch.version, "hip", None):
        return False, "torch._grouped_mm is not verified on ROCm by this plugin"
    probe = accelerator.probe()
    if not probe.available:
        return False, f"{accelerator.name} is not usable here: {probe.reason}"
    if accelerator.is_emulated():
        return False, f"{accelerator.name} runs on an emulated runtime"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    cap = _capability(accelerator)
    if cap < GROUPED_MM_MIN_CAPABILITY:
        return False, (f"torch._grouped_mm's CUTLASS kernels need compute capability "
                       f"{GROUPED_MM_MIN_CAPABILITY[0]}.{GROUPED_MM_MIN_CAPABILITY[1]}+, this GPU is {cap[0]}.{cap[1]}")
    return True, ""


# ----------------------------------------------------------------------------- the table
def _loader(module: str, attr: str) -> Callable[[], Callable]:
    """A loader returning ``attr`` of the plugin's ``module`` (relative, e.g. ``.kernels.swiglu``), imported then."""

    def load():
        return getattr(importlib.import_module(module, __package__), attr)

    return load


@dataclass(frozen=True)
class _Row:
    op: str
    name: str
    module: str
    attr: str
    kind: str
    priority: int
    compatible: Callable
    description: str


_TABLE = (
    _Row("fused_adam", "triton_fused_adam", ".kernels.optimizers", "fused_adam", "triton", TRITON_OPTIMIZER_PRIORITY,
         triton_compatible, "Triton multi-tensor Adam/AdamW: one launch over all tensors, fp32 math"),
    _Row("fused_lion", "triton_fused_lion", ".kernels.optimizers", "fused_lion", "triton", TRITON_OPTIMIZER_PRIORITY,
         triton_compatible, "Triton multi-tensor Lion: one launch over all tensors, fp32 math"),
    _Row("fused_lamb", "triton_fused_lamb", ".kernels.optimizers", "fused_lamb", "triton", TRITON_OPTIMIZER_PRIORITY,
         triton_compatible, "Triton multi-tensor LAMB: moments+norms, trust ratios, update (3 launches)"),
    _Row("fused_adam", "torch_fused_adam", ".ops", "torch_fused_adam", "torch", TORCH_FUSED_ADAM_PRIORITY,
         _torch_cuda_compatible, "torch._fused_adam(w)_ per dtype group, else torch foreach ops"),
    _Row("quantize", "triton_quantize", ".kernels.quantize", "quantize", "triton", TRITON_KERNEL_PRIORITY,
         triton_compatible, "Triton group-wise quantize: int8/int4 sym/asym on any Triton GPU; fp8 e4m3 on "
                            "compute capability 8.9+ (older GPUs raise polyaccel.Unsupported for fp8)"),
    _Row("dequantize", "triton_dequantize", ".kernels.quantize", "dequantize", "triton", TRITON_KERNEL_PRIORITY,
         triton_compatible, "Triton group-wise dequantize (int8, int4; fp8 on compute capability 8.9+)"),
    _Row("swiglu", "triton_swiglu", ".kernels.swiglu", "swiglu", "triton", TRITON_KERNEL_PRIORITY,
         triton_compatible, "Triton SwiGLU: one fused forward and one fused backward kernel, autograd-aware"),
    _Row("weighted_swiglu", "triton_weighted_swiglu", ".kernels.swiglu", "weighted_swiglu", "triton",
         TRITON_KERNEL_PRIORITY, triton_compatible,
         "Triton SwiGLU scaled by a weight per row: one fused forward, one backward per row with the weights' "
         "gradient, autograd-aware"),
    _Row("grouped_mm", "triton_grouped_mm", ".kernels.grouped_mm", "grouped_mm", "triton", TRITON_KERNEL_PRIORITY,
         triton_compatible, "Triton grouped GEMM, one launch for all experts, 64-bit offsets, bf16/fp16/fp32, "
                            "autograd-aware"),
    _Row("gather_sum", "triton_gather_sum", ".kernels.gather_sum", "gather_sum", "triton", TRITON_KERNEL_PRIORITY,
         triton_compatible, "Triton gather-sum: one pass over the rows forward, one backward (weights' gradient "
                            "included), no atomics, autograd-aware"),
    _Row("moe_gate_up", "torch_moe_gate_up", ".kernels.moe_grouped", "moe_gate_up", "torch", TORCH_MOE_PRIORITY,
         torch_moe_compatible, "one autograd node: the dispatch scattered by the gather-sum kernel, torch._grouped_mm "
                               "(CUTLASS, bf16), Triton SwiGLU; other inputs take the unfused ops"),
    _Row("moe_down_combine", "torch_moe_down_combine", ".kernels.moe_grouped", "moe_down_combine", "torch",
         TORCH_MOE_PRIORITY, torch_moe_compatible,
         "one autograd node: torch._grouped_mm (CUTLASS, bf16) and the Triton gather-sum combine; other inputs "
         "take the unfused ops"),
    _Row("newton_schulz", "triton_newton_schulz", ".kernels.newton_schulz", "newton_schulz", "triton",
         TRITON_KERNEL_PRIORITY, triton_compatible,
         "Triton Newton-Schulz: bf16/fp16 GEMMs with fp32 accumulation, batched, 3 launches an iteration "
         "(X X^T and b A + c A A on the upper tiles only); fp32/fp64 go to the reference"),
    _Row("fused_muon", "triton_fused_muon", ".kernels.newton_schulz", "fused_muon", "triton",
         TRITON_KERNEL_PRIORITY, triton_compatible,
         "Muon step: torch momentum and update around the Triton Newton-Schulz, one batched call per block "
         "shape"),
    _Row("muon_momentum", "triton_muon_momentum", ".kernels.muon_passes", "muon_momentum", "triton",
         TRITON_KERNEL_PRIORITY, triton_compatible,
         "Triton Muon momentum over pieces of flat buffers: one launch reads each gradient, updates the fp32 "
         "momentum and writes the (Nesterov) update rounded once; float64 goes to the reference"),
    _Row("muon_apply", "triton_muon_apply", ".kernels.muon_passes", "muon_apply", "triton", TRITON_KERNEL_PRIORITY,
         triton_compatible, "Triton Muon apply over pieces of flat buffers: decay and orthogonalized update with "
                            "per-piece factors in one launch; float64 goes to the reference"),
    _Row("rms_norm", "triton_rms_norm", ".kernels.rms_norm", "rms_norm", "triton", TRITON_KERNEL_PRIORITY,
         triton_compatible, "Triton RMSNorm: one program per row forward (fp32 sums, rstd kept), backward over row "
                            "ranges with the weight gradient as per-program partial sums then one reduce; "
                            "(1 + w) form by offset, autograd-aware"),
    _Row("rope", "triton_rope", ".kernels.rope", "rope", "triton", TRITON_KERNEL_PRIORITY, triton_compatible,
         "Triton RoPE: q and k in one launch, one program per token (cos/sin loaded once), split-half or "
         "interleaved, strided inputs read in place; backward the transposed rotation, autograd-aware"),
    _Row("grouped_mm", "torch_grouped_mm", ".kernels.grouped_mm", "torch_grouped_mm", "torch",
         TORCH_GROUPED_MM_PRIORITY, torch_grouped_mm_compatible,
         "torch._grouped_mm (CUTLASS, bf16) with the rows past the last offset zeroed; "
         "other dtypes or unaligned shapes go to the reference"),
    _Row("linear_cross_entropy", "triton_linear_cross_entropy", ".kernels.cross_entropy", "linear_cross_entropy",
         "triton", TRITON_KERNEL_PRIORITY, triton_compatible,
         "in chunks of tokens: cuBLAS logits per chunk, Triton logsumexp and the softmax gradient in place over the "
         "chunk, gradients spent in the forward (never the [N, V] logits); vocab-parallel over a group"),
    *(_Row(op, f"triton_{op}", ".kernels.logits_ops", op, "triton", TRITON_KERNEL_PRIORITY, triton_compatible,
           "Triton: one pass over each row forward (online max and sums; vocab-parallel partials combined by one "
           "all-gather), one elementwise pass backward from the logits and per-row values, autograd-aware")
      for op in ("logprobs", "entropy", "kl")),
)


def builders(ops: Collection[str] | None = None) -> list[OpBuilder]:
    """The plugin's builders (of ``ops`` only, when given): fresh objects, since a registry owns what it is given."""
    return [
        OpBuilder(op=row.op, name=row.name, device_types=("cuda",), loader=_loader(row.module, row.attr),
                  kind=row.kind, priority=row.priority, compatible=row.compatible, description=row.description)
        for row in _TABLE if ops is None or row.op in ops
    ]
