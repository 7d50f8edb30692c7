"""Op builders of the cuda plugin: Triton multi-tensor optimizers, and torch's fused Adam as fallback.

Triton builders are compatible only where :func:`triton_support.triton_compatible` says so;
``polyaccel.ops.explain("fused_adam", "cuda")`` shows the reason when they are not. Part of
the plugin's builders (quantize, swiglu, grouped_mm) live in :mod:`.kernel_builders`.
"""

from __future__ import annotations

import importlib

import torch
from polyaccel.ops import OpBuilder
from polyaccel.ops.reference import optimizers as ref

from .triton_support import triton_compatible

TRITON_PRIORITY = 100
TORCH_PRIORITY = 50


def _triton_loader(attr: str):
    def load():
        from .kernels import optimizers

        return getattr(optimizers, attr)

    return load


def torch_fused_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                     adam_w_mode=True, bias_correction=True):
    """torch's fused CUDA Adam/AdamW kernel; the reference where its preconditions do not hold."""
    ref.check_lists("fused_adam", params, grads, exp_avgs, exp_avg_sqs)
    keep = [i for i, p in enumerate(params) if p.numel()]
    if not keep:
        return
    lists = [[lst[i] for i in keep] for lst in (params, grads, exp_avgs, exp_avg_sqs)]
    dtype = lists[0][0].dtype
    if not bias_correction or any(t.dtype != dtype for lst in lists for t in lst):
        ref.fused_adam(*lists, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                       adam_w_mode=adam_w_mode, bias_correction=bias_correction)
        return
    device = lists[0][0].device
    if isinstance(step, torch.Tensor):
        step_t = step.to(device=device, dtype=torch.float32).reshape(())
    else:
        step_t = torch.full((), float(step), dtype=torch.float32, device=device)
    kernel = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    kernel(*lists, [], [step_t] * len(lists[0]), lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
           eps=eps, amsgrad=False, maximize=False)


def _torch_cuda_compatible(accelerator) -> tuple[bool, str]:
    if accelerator is None or accelerator.device_type != "cuda":
        return False, "no usable CUDA/ROCm accelerator serves device type 'cuda' here"
    if not hasattr(torch, "_fused_adamw_"):
        return False, f"torch {torch.__version__} has no fused Adam kernel"
    return True, ""


def register(registry) -> None:
    for op, what in (
        ("fused_adam", "Triton multi-tensor Adam/AdamW: one launch over all tensors, fp32 math"),
        ("fused_lion", "Triton multi-tensor Lion: one launch over all tensors, fp32 math"),
        ("fused_lamb", "Triton multi-tensor LAMB: moments+norms, trust ratios, update (3 launches)"),
    ):
        registry.add(OpBuilder(op=op, name=f"triton_{op}", device_types=("cuda",), loader=_triton_loader(op),
                               kind="triton", priority=TRITON_PRIORITY, compatible=triton_compatible,
                               description=what))
    registry.add(OpBuilder(op="fused_adam", name="torch_fused_adam", device_types=("cuda",),
                           loader=lambda: torch_fused_adam, kind="torch", priority=TORCH_PRIORITY,
                           compatible=_torch_cuda_compatible,
                           description="torch._fused_adam(w)_ (uniform dtypes), else the reference"))
    try:
        kernel_builders = importlib.import_module(f"{__package__}.kernel_builders")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.kernel_builders":
            raise
        return
    kernel_builders.register(registry)
