"""The core's own builders: the reference op for every device type, at priority 0."""

from __future__ import annotations

from . import reference
from .reference import REFERENCE_OPS
from .registry import ANY_DEVICE, OpBuilder, OpRegistry

__all__ = ["REFERENCE_OPS", "register_reference_ops"]


#: ops whose reference materialises what a device could not hold (the [N, V] logits): the core's
#: device-generic torch builder ranks above the reference everywhere (plugins rank above it)
CORE_TORCH_PRIORITY = 5


def _chunked_linear_cross_entropy():
    from .chunked_loss import linear_cross_entropy

    return linear_cross_entropy


def register_reference_ops(reg: OpRegistry) -> None:
    for op, attr in REFERENCE_OPS.items():
        reg.add(OpBuilder(op=op, name="reference", device_types=(ANY_DEVICE,),
                          loader=lambda fn=getattr(reference, attr): fn, kind="reference", priority=0,
                          plugin="core", description="plain-torch reference implementation"))
    reg.add(OpBuilder(op="linear_cross_entropy", name="chunked_linear_cross_entropy", device_types=(ANY_DEVICE,),
                      loader=_chunked_linear_cross_entropy, kind="torch", priority=CORE_TORCH_PRIORITY, plugin="core",
                      description="torch, in chunks of tokens: one chunk's logits at a time, gradients in the forward"))
