"""ZeRO data-parallel training engine (stages 1-3, CPU offload, mixed precision, sharded checkpoints).

It reaches hardware only through polyaccel's contracts (the selected accelerator, the op registry for the
optimizer step, ``polyaccel.comm`` for every collective), so it runs unchanged on any installed plugin.
The engine's methods, its config keys, offload, the same-collectives invariant, dtypes and partition sizes:
docs/zero.md (stage 3: docs/zero-stage3.md; weight decay groups: docs/zero-param-groups.md; Muon:
docs/zero-muon.md; checkpoints: docs/checkpoints.md).
"""

from __future__ import annotations

from .checkpoint import raise_if_any_failed, run_id
from .config import ZeroConfig, parse_config
from .consolidate import complete_tags, read_latest, read_meta, resolve_tag
from .engine import ZeroEngine
from .leaves import ScheduleMismatch, set_leaf_modules


def initialize(model, config=None, **kwargs) -> ZeroEngine:
    """Wrap ``model`` in a :class:`ZeroEngine` configured by ``config`` (a DeepSpeed-style dict)."""
    return ZeroEngine(model, config, **kwargs)


initialize.CONFIG_KEYS = ZeroEngine.CONFIG_KEYS  # what polyaccel.initialize checks a config's top level against


# what apps/ (``polyaccel train``) reads of a checkpoint besides the engine: its tags, its meta.json, the
# run id a save writes into it, and the collective that turns one rank's failure into every rank's error
__all__ = ["ScheduleMismatch", "ZeroConfig", "ZeroEngine", "complete_tags", "initialize", "parse_config",
           "raise_if_any_failed", "read_latest", "read_meta", "resolve_tag", "run_id", "set_leaf_modules"]
