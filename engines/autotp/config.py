"""The ``tensor_parallel`` config section, validated.

DeepSpeed's keys, so a DeepSpeed config carries over::

    "tensor_parallel": {
        "autotp_size": 4,
        "preset_model": "llama",                        # optional: a built-in rule set
        "partition_config": {                           # optional: your own rules
            "use_default_specs": true,                  # keep the model's plan (or the preset) underneath
            "strict_mode": false,                       # every Linear must be matched by some rule
            "layer_specs": [
                {"patterns": [".*\\.o_proj$"], "partition_type": "row"},
                {"patterns": [".*\\.qkv_proj$"], "partition_type": "column",
                 "shape": [[4096, 1024, 1024], -1]},    # fused sub-weights, each split on its own
                {"patterns": [".*\\.mlp\\.gate$"], "partition_type": "skip"}
            ]
        }
    }

A pattern is a regular expression matched (``re.match``, so anchored at the start) against a
module's name and against the name of its ``weight``. Partition types: ``column``, ``row``,
``skip`` (left whole), ``vocab`` (an embedding or lm_head split on the vocabulary) and
``replicated_with_grad_allreduce`` (left whole, its gradient summed over the tensor group).

:func:`parse` never modifies the caller's dict; every error names the key and what is allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from polyaccel.config_check import Bool, Int, OneOf, Regex, Section, Strings, config_error, integer_value

SECTION = "tensor_parallel"
KEYS = ("autotp_size", "partition_config", "preset_model")
PARTITION_KEYS = ("layer_specs", "use_default_specs", "strict_mode")
SPEC_KEYS = ("patterns", "partition_type", "shape", "partition_dim", "gather_output", "model_types")
PARTITION_TYPES = ("column", "row", "skip", "vocab", "replicated_with_grad_allreduce")
PRESETS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2")


@dataclass(frozen=True)
class LayerSpec:
    """One rule of ``partition_config.layer_specs``."""

    patterns: tuple[str, ...]
    partition_type: str
    #: fused sub-weights: a count of equal ones, or their sizes
    sub_params: int | tuple[int, ...] | None = None
    gather_output: bool = False
    model_types: tuple[str, ...] | None = None
    where: str = ""  # the key path, for error messages
    compiled: tuple[re.Pattern, ...] = field(default=(), compare=False, repr=False)

    def matches(self, module_name: str, model_type: str | None = None) -> bool:
        if self.model_types is not None and (model_type or "").lower() not in self.model_types:
            return False
        weight = f"{module_name}.weight"
        return any(p.match(module_name) or p.match(weight) for p in self.compiled)


@dataclass(frozen=True)
class TPConfig:
    autotp_size: int
    preset_model: str | None = None
    layer_specs: tuple[LayerSpec, ...] = ()
    use_default_specs: bool = True
    strict_mode: bool = False

    @property
    def has_user_specs(self) -> bool:
        return bool(self.layer_specs)


def _size(value, path: str, dim: int, what: str) -> int:
    """A positive integer of ``shape`` (``-1``: the weight's size on that dim, where ``what`` allows it)."""
    n = integer_value(value)
    if n is None or not (n > 0 or (n == -1 and what == "other")):
        text = {"other": "-1 or the weight's size on that dim",
                "count": "a positive count of equal sub-weights or a list of their sizes",
                "sizes": "a positive sub-weight size"}[what]
        raise config_error(f"{path}[{dim}]", f"must be {text}, got {value!r}")
    return n


def _shape(spec: Section, partition_type: str):
    """DeepSpeed's ``shape``: ``[k, -1]`` (k equal sub-weights) or ``[[a, b, c], -1]`` on the split dim."""
    dim = 0 if partition_type == "column" else 1
    partition_dim = spec.get("partition_dim", Int(0, optional=True))
    if partition_dim is not None and partition_dim != dim:
        raise spec.error("partition_dim", f"is {partition_dim}: a {partition_type} split of a 2-D weight is "
                         f"on dim {dim}; other dims are not supported")
    shape, path = spec.raw("shape"), spec.key("shape")
    if shape is None:
        return None
    if partition_type not in ("column", "row"):
        raise spec.error("shape", f"is taken by column and row rules only, not {partition_type!r}")
    if not isinstance(shape, (list, tuple)) or len(shape) != 2:
        raise spec.error("shape", f"must have two entries, e.g. [3, -1] or [[q, k, v], -1] for a column rule "
                         f"(the split dim first), got {shape!r}")
    _size(shape[1 - dim], path, 1 - dim, "other")
    sub = shape[dim]
    if isinstance(sub, (list, tuple)) and sub:
        return tuple(_size(s, f"{path}[{dim}]", i, "sizes") for i, s in enumerate(sub))
    return _size(sub, path, dim, "count")


def _spec(path: str, raw) -> LayerSpec:
    spec = Section(raw, path, SPEC_KEYS)
    raw_patterns = spec.require("patterns", "the regular expressions matched against module names")
    patterns = Strings(what="regular expressions", nonempty=True).check(raw_patterns, spec.key("patterns"))
    compiled = tuple(re.compile(Regex().check(p, f"{spec.key('patterns')}[{i}]"))
                     for i, p in enumerate(patterns))
    ptype = spec.get("partition_type", OneOf(PARTITION_TYPES), "column")
    gather = spec.get("gather_output", Bool(), False)
    if gather and ptype != "column":
        raise spec.error("gather_output", f"applies to column rules only (this one is {ptype!r})")
    sub = _shape(spec, ptype)
    types = spec.get("model_types", Strings(what="model_type strings", optional=True))
    types = tuple(t.lower() for t in types) if types is not None else None
    return LayerSpec(patterns, ptype, sub, gather, types, path, compiled)


def parse(section, where: str = SECTION) -> TPConfig:
    """Validate a ``tensor_parallel`` section (not modified) into a :class:`TPConfig`."""
    if isinstance(section, TPConfig):
        return section
    sec = Section(section, where, KEYS)
    size = sec.require("autotp_size", "the number of ranks that share each layer (1 turns tensor parallelism "
                       "off)", Int(1))
    preset = sec.get("preset_model", OneOf(PRESETS, optional=True))
    pc = sec.section("partition_config", PARTITION_KEYS)
    specs = tuple(_spec(path, raw) for path, raw in pc.items("layer_specs"))
    use_default = pc.get("use_default_specs", Bool(), True)
    strict = pc.get("strict_mode", Bool(), False)
    return TPConfig(size, preset, specs, use_default, strict)


__all__ = ["KEYS", "PARTITION_TYPES", "PRESETS", "LayerSpec", "TPConfig", "parse"]
