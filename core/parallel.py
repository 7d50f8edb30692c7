"""The per-parameter interface through which the engine layers meet.

A layer that changes how a parameter is laid out over the mesh (AutoTP splits it over
``tensor``, AutoEP places it on one ``expert`` rank) says so by attaching a
:class:`ParamLayout` to the parameter; ZeRO and the checkpoint code read it. That is the
whole contract: no layer imports another's internals.

What a layout answers, for one parameter on this rank:

- ``replicas``: the mesh dimension whose ranks hold copies of this local tensor and see
  different data. ZeRO partitions the parameter's optimizer state over it and sums its
  gradients over it, divided by the number of distinct batches, ``mesh.size("batch")`` (an
  expert's gradient already holds its whole expert group's tokens; the sequence ranks of one
  group, data replicas too, hold parts of one batch): ``"data"`` for dense parameters,
  ``"expert_data"`` for experts.
- ``grad_sum``: a mesh dimension over which the local gradients are *partial* and must be
  summed (a replicated parameter applied to tensor-sharded activations, e.g. Qwen3's
  ``q_norm``): ``"tensor"`` or None.
- ``split``: how the full parameter is cut over a mesh dimension (None: this rank holds it
  whole). Used by checkpoints (to consolidate and to re-split at another degree) and by the
  gradient norm (a split parameter's pieces are counted once each; a whole one once in all).

A parameter without a layout has ``ParamLayout()``: replicated over ``data``, not split.

A layer also leaves its plan (what it did, printable) on the model with :func:`set_plan`, under
the mesh dimension it works on; engines show it (``engine.tp_plan``, ``engine.ep_plan``)
through :func:`get_plan` without knowing the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError

REPLICA_DIMS = ("data", "expert_data")
SPLIT_DIMS = ("tensor", "expert")
_ATTR = "_polyaccel_layout"


@dataclass(frozen=True)
class Split:
    """The full tensor along ``axis`` is the concatenation, over sections j, of the pieces of
    section j on ranks 0..n-1 of ``dim``; ``sections[j][r]`` is the length of that piece.

    One section is a plain (possibly uneven) split; a fused weight such as ``[q | k | v]``
    has one section per sub-weight so each rank holds ``[q_r | k_r | v_r]``.
    """

    dim: str
    axis: int
    sections: tuple[tuple[int, ...], ...]
    rank: int

    def __post_init__(self):
        if self.dim not in SPLIT_DIMS:
            raise ConfigError(f"Split.dim must be one of {list(SPLIT_DIMS)}, got {self.dim!r}")
        if not self.sections or len({len(s) for s in self.sections}) != 1:
            raise ConfigError(f"Split.sections must be non-empty and give one size per rank, got {self.sections!r}")

    @property
    def degree(self) -> int:
        return len(self.sections[0])

    @property
    def full_length(self) -> int:
        return sum(sum(s) for s in self.sections)

    def local_length(self, rank: int | None = None) -> int:
        r = self.rank if rank is None else rank
        return sum(s[r] for s in self.sections)

    def piece(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """This rank's (or ``rank``'s) piece of the full tensor."""
        r = self.rank if rank is None else rank
        parts, start = [], 0
        for sec in self.sections:
            parts.append(full.narrow(self.axis, start + sum(sec[:r]), sec[r]))
            start += sum(sec)
        return torch.cat(parts, dim=self.axis) if len(parts) > 1 else parts[0]

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece (in rank order)."""
        out = []
        for j, _sec in enumerate(self.sections):
            for r, p in enumerate(pieces):
                off = sum(s[r] for s in self.sections[:j])
                out.append(p.narrow(self.axis, off, self.sections[j][r]))
        return torch.cat(out, dim=self.axis)


@dataclass(frozen=True)
class ParamLayout:
    replicas: str = "data"
    grad_sum: str | None = None
    split: Split | None = None

    def __post_init__(self):
        if self.replicas not in REPLICA_DIMS:
            raise ConfigError(f"ParamLayout.replicas must be one of {list(REPLICA_DIMS)}, got {self.replicas!r}")
        if self.grad_sum not in (None, "tensor"):
            raise ConfigError(f"ParamLayout.grad_sum must be None or 'tensor', got {self.grad_sum!r}")


DEFAULT = ParamLayout()


def set_layout(param: torch.Tensor, layout: ParamLayout) -> None:
    if not isinstance(layout, ParamLayout):
        raise TypeError(f"set_layout needs a ParamLayout, got {type(layout).__name__}")
    setattr(param, _ATTR, layout)


def get_layout(param: torch.Tensor) -> ParamLayout:
    return getattr(param, _ATTR, DEFAULT)


_PLANS = "_polyaccel_plans"


#: what a plan is recorded under: the mesh dimension a layer works on, or a layer that works on none
PLAN_KEYS = (*SPLIT_DIMS, "kernels")


def set_plan(model: torch.nn.Module, dim: str, plan) -> None:
    """Record the plan a layer applied to ``model`` over mesh dimension ``dim`` ("tensor", "expert"), or under
    "kernels" (the model-kernels layer, which works on no mesh dimension)."""
    if dim not in PLAN_KEYS:
        raise ConfigError(f"a plan is recorded under one of {list(PLAN_KEYS)}, got {dim!r}")
    plans = model.__dict__.setdefault(_PLANS, {})
    plans[dim] = plan


def get_plan(model: torch.nn.Module, dim: str):
    """The plan recorded for ``dim`` on ``model``, or None."""
    return model.__dict__.get(_PLANS, {}).get(dim)
