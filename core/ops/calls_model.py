"""The entry points of the model-layer ops ``rms_norm`` and ``rope``: the contract check, then the builder.

Like every op call (:mod:`.calls`) they resolve the builder for the tensors' device type through the
process's op registry (once, then cached) and refuse a call the contract does not allow before any
builder runs, with every tensor untouched. A builder made with the reference's ``make_rms_norm`` /
``make_rope`` checks its arguments itself too; its ``unchecked`` form is called here, so a call is
checked once.
"""

from __future__ import annotations

import torch

from ..runtime import current
from .reference.rms_norm import check_rms_norm_args
from .reference.rope import check_rope_args

_RUNTIME = current()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *, offset: float = 0.0) -> torch.Tensor:
    """``rms_norm`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.rms_norm` (docs/plugin-authoring.md).
    """
    check_rms_norm_args(x, weight, eps, offset)
    fn = _RUNTIME.ops.resolve("rms_norm", x.device.type)
    return getattr(fn, "unchecked", fn)(x, weight, eps, offset=offset)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
         interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope`` through the best builder for the tensors' device type.

    Semantics and signature: :func:`polyaccel.ops.reference.rope` (docs/plugin-authoring.md).
    """
    check_rope_args(q, k, cos, sin, interleaved)
    fn = _RUNTIME.ops.resolve("rope", q.device.type)
    return getattr(fn, "unchecked", fn)(q, k, cos, sin, interleaved=interleaved)
