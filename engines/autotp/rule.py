"""One module's rule while the plan is inferred: its internal style and where it came from."""

from __future__ import annotations

from dataclasses import dataclass

from .config import LayerSpec
from .plan_objects import COLUMN, COLUMN_GATHER, GRAD_SUM, ROW, SKIP, VOCAB_EMBED, VOCAB_HEAD


@dataclass
class Rule:
    style: str  # an internal style, or "?<hf style>" for a style AutoTP does not run
    source: str
    rule: str
    sub_params: int | tuple[int, ...] | None = None


def spec_rule(spec: LayerSpec, source: str, kind: str | None) -> Rule:
    """The rule a ``layer_specs`` entry (the user's, or a preset's) gives a module of ``kind``."""
    t = spec.partition_type
    if t == "skip":
        style = SKIP
    elif t == "replicated_with_grad_allreduce":
        style = GRAD_SUM
    elif t == "vocab":
        style = VOCAB_EMBED if kind == "embedding" else VOCAB_HEAD
    elif t == "column":
        style = COLUMN_GATHER if spec.gather_output else COLUMN
    else:
        style = ROW
    rule = f"{t} ({spec.where}: {spec.patterns[0]!r})" if source == "partition_config" else t
    return Rule(style, source, rule, spec.sub_params)
