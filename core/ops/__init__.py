"""Ops: one semantics everywhere, the best available builder per device type.

Call ``polyaccel.ops.fused_adam(...)`` and friends; each call resolves (once, then
cached) the builder for the device type of its tensors. ``explain(op)`` tells which
builder was picked and why; ``override(op, builder)`` or ``POLYACCEL_OP_OVERRIDES``
forces one.

Each entry point checks its call against the op's contract (:mod:`.contract`: hyperparameters,
list lengths, shapes, one device, no aliased memory in written tensors) and then hands the
builder the caller's tensors unchanged, strides and all: a builder whose kernel needs another
layout stages the tensors itself (:mod:`.layout`). See docs/plugin-authoring.md.
"""

from __future__ import annotations

from ..runtime import current
from . import contract  # noqa: F401 -- polyaccel.ops.contract, as before
from .calls import (
    dequantize,
    explain,
    fused_adam,
    fused_lamb,
    fused_lion,
    fused_muon,
    gather_sum,
    grouped_mm,
    moe_down_combine,
    moe_gate_up,
    muon_apply,
    muon_momentum,
    newton_schulz,
    override,
    provides,
    quantize,
    resolve,
    swiglu,
    weighted_swiglu,
)
from .calls_loss import entropy, kl, linear_cross_entropy, logprobs
from .calls_model import rms_norm, rope
from .reference.quantize import QuantizedTensor
from .registry import ANY_DEVICE, Candidate, OpBuilder, OpRegistry

# ``from .registry import`` bound the submodule as this package's ``registry``; that name is the
# process's op registry (below), so the binding goes: ``polyaccel.ops.registry`` the module stays
# importable by its dotted name, and the attribute asks the runtime.
del registry  # noqa: F821 -- bound by the import system, not by a statement here


def __getattr__(name: str):
    """``registry``: the process's op registry (the runtime's), looked up on use, filled at discovery."""
    if name == "registry":
        return current().ops
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ANY_DEVICE", "Candidate", "OpBuilder", "OpRegistry", "QuantizedTensor", "dequantize", "entropy", "explain",
    "fused_adam", "fused_lamb", "fused_lion", "fused_muon", "gather_sum", "grouped_mm", "moe_down_combine",
    "moe_gate_up", "kl", "linear_cross_entropy", "logprobs", "muon_apply", "muon_momentum", "newton_schulz",
    "override", "provides", "quantize",
    "registry", "resolve", "rms_norm", "rope", "swiglu", "weighted_swiglu",
]
