"""How results and stand-ins produced under emulation are labelled."""

from __future__ import annotations

from typing import Any

from ...hookspecs import EMULATED_MARKER

#: The label every result produced under emulation carries.
EMULATED = "emulated"

__all__ = ["EMULATED", "EMULATED_MARKER", "is_emulated_module", "mark_emulated"]


def is_emulated_module(obj: Any) -> bool:
    """True when ``obj`` is (part of) an emulated runtime installed by this kit."""
    return getattr(obj, EMULATED_MARKER, False) is True


def mark_emulated(obj: Any) -> Any:
    """Set the :data:`EMULATED_MARKER` on a stand-in module or object; returns it."""
    setattr(obj, EMULATED_MARKER, True)
    return obj
