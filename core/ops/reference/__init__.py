"""Plain-torch reference implementations: the definition of every op and the fallback."""

from .grouped_mm import grouped_mm
from .optimizers import fused_adam, fused_lamb, fused_lion
from .quantize import QuantizedTensor, dequantize, quantize
from .swiglu import swiglu, swiglu_backward, swiglu_forward

__all__ = [
    "QuantizedTensor",
    "dequantize",
    "fused_adam",
    "fused_lamb",
    "fused_lion",
    "grouped_mm",
    "quantize",
    "swiglu",
    "swiglu_backward",
    "swiglu_forward",
]
