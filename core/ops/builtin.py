"""The core's own builders: the reference op for every device type, at priority 0."""

from __future__ import annotations

from . import reference
from .reference import REFERENCE_OPS
from .registry import ANY_DEVICE, OpBuilder, OpRegistry

__all__ = ["REFERENCE_OPS", "register_reference_ops"]


def register_reference_ops(reg: OpRegistry) -> None:
    for op, attr in REFERENCE_OPS.items():
        reg.add(OpBuilder(op=op, name="reference", device_types=(ANY_DEVICE,),
                          loader=lambda fn=getattr(reference, attr): fn, kind="reference", priority=0,
                          plugin="core", description="plain-torch reference implementation"))
