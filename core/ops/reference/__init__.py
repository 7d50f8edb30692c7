"""Plain-torch reference implementations: the definition of every op and the fallback."""

from .cross_entropy import entropy, kl, linear_cross_entropy, logprobs
from .gather_sum import gather_sum, gather_sum_backward, gather_sum_forward, make_gather_sum
from .grouped_mm import grouped_mm
from .moe_experts import moe_down_combine, moe_gate_up
from .muon import fused_muon, newton_schulz
from .muon_passes import muon_apply, muon_momentum
from .optimizers import fused_adam, fused_lamb, fused_lion
from .quantize import QuantizedTensor, dequantize, quantize
from .rms_norm import make_rms_norm, rms_norm
from .rope import make_rope, rope
from .swiglu import (
    make_swiglu,
    make_weighted_swiglu,
    swiglu,
    swiglu_backward,
    swiglu_forward,
    weighted_swiglu,
    weighted_swiglu_backward,
    weighted_swiglu_forward,
)

#: op name -> the function of this package that defines it
REFERENCE_OPS = {
    "fused_adam": "fused_adam",
    "fused_lion": "fused_lion",
    "fused_lamb": "fused_lamb",
    "quantize": "quantize",
    "dequantize": "dequantize",
    "swiglu": "swiglu",
    "weighted_swiglu": "weighted_swiglu",
    "grouped_mm": "grouped_mm",
    "gather_sum": "gather_sum",
    "moe_gate_up": "moe_gate_up",
    "moe_down_combine": "moe_down_combine",
    "newton_schulz": "newton_schulz",
    "fused_muon": "fused_muon",
    "muon_momentum": "muon_momentum",
    "muon_apply": "muon_apply",
    "rms_norm": "rms_norm",
    "rope": "rope",
    "linear_cross_entropy": "linear_cross_entropy",
    "logprobs": "logprobs",
    "entropy": "entropy",
    "kl": "kl",
}

__all__ = [
    "REFERENCE_OPS",
    "QuantizedTensor",
    "dequantize",
    "entropy",
    "fused_adam",
    "fused_lamb",
    "fused_lion",
    "fused_muon",
    "gather_sum",
    "gather_sum_backward",
    "gather_sum_forward",
    "grouped_mm",
    "kl",
    "linear_cross_entropy",
    "logprobs",
    "make_gather_sum",
    "make_rms_norm",
    "make_rope",
    "make_swiglu",
    "make_weighted_swiglu",
    "moe_down_combine",
    "moe_gate_up",
    "muon_apply",
    "muon_momentum",
    "newton_schulz",
    "op_reference_markdown",
    "quantize",
    "rms_norm",
    "rope",
    "swiglu",
    "swiglu_backward",
    "swiglu_forward",
    "weighted_swiglu",
    "weighted_swiglu_backward",
    "weighted_swiglu_forward",
]


def _signature(fn) -> str:
    import inspect

    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return f"{fn.__name__}{sig.replace(parameters=params, return_annotation=inspect.Signature.empty)}"


def op_reference_markdown() -> str:
    """The signature and semantics of every op, from these functions' docstrings, as Markdown.

    docs/plugin-authoring.md carries this text (a test checks it is current); regenerate it
    with ``python -m polyaccel.ops.reference``.
    """
    import inspect

    parts = []
    for op, attr in REFERENCE_OPS.items():
        fn = globals()[attr]
        parts.append(f"#### `{op}`\n\n```python\n{_signature(fn)}\n```\n\n{inspect.cleandoc(fn.__doc__)}\n")
    return "\n".join(parts)
