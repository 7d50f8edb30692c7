"""The ``tensor_parallel`` config section, validated.

DeepSpeed's keys, so a DeepSpeed config carries over::

    "tensor_parallel": {
        "autotp_size": 4,
        "preset_model": "llama",                        # optional: a built-in rule set
        "partition_config": {                           # optional: your own rules
            "use_default_specs": true,                  # also keep the model's plan (or the preset) underneath
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

from polyaccel.errors import ConfigError

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
    sub_params: int | tuple[int, ...] | None = None  # fused sub-weights: a count of equal ones, or their sizes
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


def _unknown(where: str, keys, allowed) -> None:
    bad = [k for k in keys if k not in allowed]
    if bad:
        raise ConfigError(f"{where}: unknown key{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}; "
                          f"allowed keys are {list(allowed)}")


def _bool(where: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    return value


def _positive_int(where: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where} must be a positive int, got {value!r}")
    return value


def _shape(where: str, shape, partition_type: str, partition_dim):
    """DeepSpeed's ``shape``: ``[k, -1]`` (k equal sub-weights) or ``[[a, b, c], -1]`` on the split dim."""
    dim = 0 if partition_type == "column" else 1
    if partition_dim is not None and partition_dim != dim:
        raise ConfigError(f"{where}.partition_dim {partition_dim!r}: a {partition_type} split of a 2-D weight "
                          f"is on dim {dim}; other dims are not supported")
    if shape is None:
        return None
    if partition_type not in ("column", "row"):
        raise ConfigError(f"{where}.shape: only column and row rules take a shape, not {partition_type!r}")
    if not isinstance(shape, (list, tuple)) or len(shape) != 2:
        raise ConfigError(f"{where}.shape must have two entries, e.g. [3, -1] or [[q, k, v], -1] for a column "
                          f"rule (the split dim first), got {shape!r}")
    other = shape[1 - dim]
    if not (other == -1 or (isinstance(other, int) and not isinstance(other, bool) and other > 0)):
        raise ConfigError(f"{where}.shape[{1 - dim}] must be -1 or the weight's size on that dim, got {other!r}")
    sub = shape[dim]
    if isinstance(sub, (list, tuple)):
        if not sub or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sub):
            raise ConfigError(f"{where}.shape[{dim}] must list positive sub-weight sizes, got {sub!r}")
        return tuple(sub)
    if isinstance(sub, int) and not isinstance(sub, bool) and sub > 0:
        return sub
    raise ConfigError(f"{where}.shape[{dim}] must be a positive count of equal sub-weights or a list of their "
                      f"sizes, got {sub!r}")


def _spec(where: str, raw) -> LayerSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a dict with keys {list(SPEC_KEYS)}, got {type(raw).__name__}")
    _unknown(where, raw, SPEC_KEYS)
    patterns = raw.get("patterns")
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, (list, tuple)) or not patterns or not all(isinstance(p, str) for p in patterns):
        raise ConfigError(f"{where}.patterns must be a non-empty list of regular expressions, got {patterns!r}")
    compiled = []
    for i, p in enumerate(patterns):
        try:
            compiled.append(re.compile(p))
        except re.error as exc:
            raise ConfigError(f"{where}.patterns[{i}] {p!r} is not a valid regular expression: {exc}") from None
    ptype = raw.get("partition_type", "column")
    if not isinstance(ptype, str) or ptype.lower() not in PARTITION_TYPES:
        raise ConfigError(f"{where}.partition_type {ptype!r}: allowed values are {list(PARTITION_TYPES)}")
    ptype = ptype.lower()
    gather = _bool(f"{where}.gather_output", raw.get("gather_output", False))
    if gather and ptype != "column":
        raise ConfigError(f"{where}.gather_output applies to column rules only (this one is {ptype!r})")
    sub = _shape(where, raw.get("shape"), ptype, raw.get("partition_dim"))
    types = raw.get("model_types")
    if types is not None:
        if not isinstance(types, (list, tuple)) or not all(isinstance(t, str) for t in types):
            raise ConfigError(f"{where}.model_types must be a list of model_type strings, got {types!r}")
        types = tuple(t.lower() for t in types)
    return LayerSpec(tuple(patterns), ptype, sub, gather, types, where, tuple(compiled))


def parse(section, where: str = SECTION) -> TPConfig:
    """Validate a ``tensor_parallel`` section (not modified) into a :class:`TPConfig`."""
    if isinstance(section, TPConfig):
        return section
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a dict with keys {list(KEYS)}, got {type(section).__name__}")
    _unknown(where, section, KEYS)
    if "autotp_size" not in section:
        raise ConfigError(f"{where}.autotp_size is required: the number of ranks that share each layer (1 turns "
                          "tensor parallelism off)")
    size = _positive_int(f"{where}.autotp_size", section["autotp_size"])
    preset = section.get("preset_model")
    if preset is not None and (not isinstance(preset, str) or preset.lower() not in PRESETS):
        raise ConfigError(f"{where}.preset_model {preset!r}: allowed values are {list(PRESETS)}")
    preset = preset.lower() if preset else None
    pc = section.get("partition_config")
    specs: tuple[LayerSpec, ...] = ()
    use_default, strict = True, False
    if pc is not None:
        pw = f"{where}.partition_config"
        if not isinstance(pc, dict):
            raise ConfigError(f"{pw} must be a dict with keys {list(PARTITION_KEYS)}, got {type(pc).__name__}")
        _unknown(pw, pc, PARTITION_KEYS)
        raw_specs = pc.get("layer_specs", [])
        if not isinstance(raw_specs, (list, tuple)):
            raise ConfigError(f"{pw}.layer_specs must be a list of rules, got {type(raw_specs).__name__}")
        specs = tuple(_spec(f"{pw}.layer_specs[{i}]", s) for i, s in enumerate(raw_specs))
        use_default = _bool(f"{pw}.use_default_specs", pc.get("use_default_specs", True))
        strict = _bool(f"{pw}.strict_mode", pc.get("strict_mode", False))
    return TPConfig(size, preset, specs, use_default, strict)


__all__ = ["KEYS", "PARTITION_TYPES", "PRESETS", "LayerSpec", "TPConfig", "parse"]
