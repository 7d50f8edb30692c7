"""The core's own builders: the reference op for every device type, at priority 0."""

from __future__ import annotations

from .registry import ANY_DEVICE, OpBuilder, OpRegistry

#: op name -> attribute of polyaccel.ops.reference implementing it
REFERENCE_OPS = {
    "fused_adam": "fused_adam",
    "fused_lion": "fused_lion",
    "fused_lamb": "fused_lamb",
    "quantize": "quantize",
    "dequantize": "dequantize",
    "swiglu": "swiglu",
    "grouped_mm": "grouped_mm",
}


def _loader(attr: str):
    def load():
        from . import reference

        return getattr(reference, attr)

    return load


def register_reference_ops(reg: OpRegistry) -> None:
    for op, attr in REFERENCE_OPS.items():
        reg.add(OpBuilder(op=op, name="reference", device_types=(ANY_DEVICE,), loader=_loader(attr),
                          kind="reference", priority=0, plugin="core",
                          description="plain-torch reference implementation"))
