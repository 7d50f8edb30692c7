"""Validate the ``expert_parallel`` config section into a frozen :class:`AutoEPConfig`.

DeepSpeed's key names where it has them (``enabled``, ``autoep_size``, ``preset_model``,
``top_k``, ``score_func``, ``score_apply``, ``route_norm``, ``routed_scaling_factor``,
``num_expert_groups``, ``num_limited_groups``, ``moe_layer_pattern``, ``router_pattern``,
``expert_pattern``, ``expert_w1/w2/w3``, ``num_experts_attr``, ``top_k_attr``), plus
``group_score`` and the shared-expert names. Unknown keys are rejected with the allowed ones
listed; a bad value names its key and the allowed values; the caller's dict is only read.

A routing knob left at ``None``/``"auto"`` takes the detected family's value (see
:mod:`.presets`); a value given here overrides the family for every detected layer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from polyaccel.errors import ConfigError

from .presets import PRESETS

SECTION = "expert_parallel"
#: the mesh dimension this section sets, and the key that sets it (named in mesh errors)
SIZE_KEYS = {"expert": "autoep_size"}
SCORE_FUNCS = ("auto", "softmax", "sigmoid")
SCORE_APPLY = ("auto", "pre", "post")
GROUP_SCORES = ("auto", "max", "top2_sum")


#: why expert weights are not split over the tensor ranks
ETP_REFUSED = (
    "splitting expert weights over the tensor ranks is not supported, only 1 (the default). With tensor "
    "parallelism, AutoEP keeps every expert whole: each tensor rank holds its expert rank's experts and runs them "
    "on the same tokens (the MoE block's input is replicated over tensor), so expert state is replicated over "
    "tensor and ZeRO partitions it over expert_data. Splitting an expert over tensor as well would cut one weight "
    "over two mesh dimensions (experts over expert, features over tensor), which a parameter's layout, the "
    "gradient norm and the checkpoint format do not describe. Use a larger autoep_size to spread the experts "
    "over more ranks instead")


@dataclass(frozen=True)
class AutoEPConfig:
    enabled: bool = True
    #: expert-parallel degree: the experts of every MoE layer are split over this many ranks
    autoep_size: int = 1
    #: tensor ranks each expert weight is split over: 1 only (see :data:`ETP_REFUSED`)
    expert_tensor_parallel_size: int = 1
    #: "auto" (from ``model.config.model_type``) or a preset name (:data:`.presets.PRESETS`)
    preset_model: str = "auto"
    # routing knobs: None / "auto" = the family's value
    top_k: int | None = None
    score_func: str = "auto"
    score_apply: str = "auto"
    route_norm: bool | None = None
    routed_scaling_factor: float | None = None
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    group_score: str = "auto"
    # structure overrides (None = detect)
    moe_layer_pattern: str | None = None  # regex, full match against named_modules() names
    router_pattern: str | None = None  # child name of the router in a MoE block
    expert_pattern: str | None = None  # child name of the experts in a MoE block
    expert_w1: str | None = None  # per-expert gate projection (ModuleList experts)
    expert_w2: str | None = None  # per-expert down projection
    expert_w3: str | None = None  # per-expert up projection
    num_experts_attr: str | None = None  # model.config attribute with the expert count
    top_k_attr: str | None = None  # model.config attribute with top-k
    shared_expert_pattern: str | None = None  # child name of the shared expert(s)
    shared_expert_gate_pattern: str | None = None  # child name of the shared expert's sigmoid gate
    #: replay each layer's routed experts from device graphs (ep 1; engines/autoep/graphed.py)
    capture_graphs: bool = False


def _int(key: str, value: Any, minimum: int, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " or null" if allow_none else ""
        raise ConfigError(f"config key '{SECTION}.{key}' must be an integer >= {minimum}{extra}, got {value!r}")
    return value


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value is None:
        value = "auto"
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ConfigError(f"config key '{SECTION}.{key}' must be one of {', '.join(allowed)}, got {value!r}")
    return value.lower()


def _name(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"config key '{SECTION}.{key}' must be a non-empty string or null, got {value!r}")
    return value


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"config key '{SECTION}.{key}' must be true or false, got {value!r}")
    return value


def _optional_flag(key: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"config key '{SECTION}.{key}' must be true, false or null, got {value!r}")
    return value


def _positive_scale(key: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config key '{SECTION}.{key}' must be a finite number > 0 or null, got {value!r}")
    return float(value)


def _expert_tensor_parallel_size(key: str, value: Any) -> int:
    etp = _int(key, value, 1)
    if etp != 1:
        raise ConfigError(f"config key '{SECTION}.{key}' is {etp}: {ETP_REFUSED}")
    return etp


def _preset_name(key: str, value: Any) -> str:
    return _choice(key, value, ("auto", *sorted(PRESETS)))


def _regex(key: str, value: Any) -> str | None:
    pattern = _name(key, value)
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"config key '{SECTION}.{key}' is not a valid regular expression ({exc}): "
                              f"{pattern!r}") from None
    return pattern


def _check_graphs(out: dict[str, Any]) -> None:
    """Graphs fix every size on the path; an all-to-all's row counts change every step."""
    if out.get("capture_graphs") and out.get("autoep_size", 1) > 1:
        raise ConfigError(f"config key '{SECTION}.capture_graphs' needs '{SECTION}.autoep_size' 1 (it is "
                          f"{out['autoep_size']}): a device graph fixes the rows each expert rank receives, which the "
                          "all-to-all changes every step")


def _check_expert_groups(out: dict[str, Any]) -> None:
    """Group-limited routing needs both of its keys, and picks from no more groups than there are."""
    groups, limited = out.get("num_expert_groups"), out.get("num_limited_groups")
    if (groups is None) != (limited is None):
        raise ConfigError(f"config keys '{SECTION}.num_expert_groups' and '{SECTION}.num_limited_groups' go "
                          "together (group-limited routing): set both or neither")
    if groups is not None and limited > groups:
        raise ConfigError(f"config key '{SECTION}.num_limited_groups' ({limited}) must not "
                          f"exceed '{SECTION}.num_expert_groups' ({groups})")


def _check_expert_projections(out: dict[str, Any]) -> None:
    """The per-expert projection names are one override: all three or none."""
    ws = [out.get(k) for k in ("expert_w1", "expert_w2", "expert_w3")]
    if any(w is not None for w in ws) and not all(w is not None for w in ws):
        raise ConfigError(f"config keys '{SECTION}.expert_w1', 'expert_w2' and 'expert_w3' go together (the "
                          "per-expert gate, down and up projections): set all three or none")


_Validator = Callable[[str, Any], Any]
_positive_int = partial(_int, minimum=1)
_optional_positive_int = partial(_int, minimum=1, allow_none=True)

#: the keys of the section, one table per part: each key's validator ``(key, value) -> parsed value``,
#: then the check across that part's keys. parse_config checks the parts and their keys in this order.
_SCHEMA: tuple[tuple[dict[str, _Validator], Callable[[dict[str, Any]], None] | None], ...] = (
    ({"enabled": _flag, "autoep_size": _positive_int,
      "expert_tensor_parallel_size": _expert_tensor_parallel_size, "capture_graphs": _flag}, _check_graphs),
    ({"preset_model": _preset_name, "top_k": _optional_positive_int,
      "score_func": partial(_choice, allowed=SCORE_FUNCS), "score_apply": partial(_choice, allowed=SCORE_APPLY),
      "group_score": partial(_choice, allowed=GROUP_SCORES), "route_norm": _optional_flag,
      "routed_scaling_factor": _positive_scale, "num_expert_groups": _optional_positive_int,
      "num_limited_groups": _optional_positive_int}, _check_expert_groups),
    ({"moe_layer_pattern": _regex, **dict.fromkeys(
        ("router_pattern", "expert_pattern", "expert_w1", "expert_w2", "expert_w3", "num_experts_attr",
         "top_k_attr", "shared_expert_pattern", "shared_expert_gate_pattern"), _name)}, _check_expert_projections),
)
_KEYS = {key for validators, _ in _SCHEMA for key in validators}


def _section_dict(section: Any) -> dict:
    """``section`` as a dict of known keys (None is the empty section)."""
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"config key {SECTION!r} must be a dict, got {type(section).__name__}")
    unknown = sorted(set(section) - _KEYS)
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(repr(f'{SECTION}.{k}') for k in unknown)}; "
            f"allowed keys in {SECTION!r}: {', '.join(sorted(_KEYS))}")
    return section


def parse_config(section: Any) -> AutoEPConfig:
    """The validated section (``section`` itself is not modified)."""
    section = _section_dict(section)
    out: dict[str, Any] = {}
    for validators, check_together in _SCHEMA:
        for key, validate in validators.items():
            if key in section:
                out[key] = validate(key, section[key])
        if check_together is not None:
            check_together(out)
    return AutoEPConfig(**out)


def mesh_sizes(section: Any) -> dict[str, int]:
    cfg = parse_config(section)
    return {"expert": cfg.autoep_size if cfg.enabled else 1}
