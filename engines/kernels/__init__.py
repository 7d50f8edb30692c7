"""Model kernels: the plugins' RMSNorm, RoPE, SwiGLU and fused linear cross-entropy swapped into Hugging Face
models, by what their modules compute (docs/model-kernels.md).

Turned on by the ``kernels`` config section of :func:`polyaccel.initialize` (see :mod:`.config`), or applied
directly with :func:`apply_kernels`; :func:`get_plan` tells what was swapped and what was left alone.
"""

from .apply import apply_kernels, get_plan, plan_kernels
from .config import KERNELS, KernelsConfig, parse
from .plan import KernelPlan

__all__ = ["KERNELS", "KernelPlan", "KernelsConfig", "apply_kernels", "get_plan", "parse", "plan_kernels"]
