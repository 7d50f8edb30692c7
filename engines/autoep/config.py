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
from dataclasses import dataclass
from typing import Any

from polyaccel.errors import ConfigError

SECTION = "expert_parallel"
#: the mesh dimension this section sets, and the key that sets it (named in mesh errors)
SIZE_KEYS = {"expert": "autoep_size"}
SCORE_FUNCS = ("auto", "softmax", "sigmoid")
SCORE_APPLY = ("auto", "pre", "post")
GROUP_SCORES = ("auto", "max", "top2_sum")

_KEYS = {
    "enabled", "autoep_size", "preset_model", "top_k", "score_func", "score_apply", "route_norm",
    "routed_scaling_factor", "num_expert_groups", "num_limited_groups", "group_score", "moe_layer_pattern",
    "router_pattern", "expert_pattern", "expert_w1", "expert_w2", "expert_w3", "num_experts_attr", "top_k_attr",
    "shared_expert_pattern", "shared_expert_gate_pattern", "expert_tensor_parallel_size",
}


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


def parse_config(section: Any) -> AutoEPConfig:
    """The validated section (``section`` itself is not modified)."""
    from .presets import PRESETS

    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ConfigError(f"config key {SECTION!r} must be a dict, got {type(section).__name__}")
    unknown = sorted(set(section) - _KEYS)
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(repr(f'{SECTION}.{k}') for k in unknown)}; "
            f"allowed keys in {SECTION!r}: {', '.join(sorted(_KEYS))}")
    out: dict[str, Any] = {}
    if "enabled" in section:
        if not isinstance(section["enabled"], bool):
            raise ConfigError(f"config key '{SECTION}.enabled' must be true or false, got {section['enabled']!r}")
        out["enabled"] = section["enabled"]
    if "autoep_size" in section:
        out["autoep_size"] = _int("autoep_size", section["autoep_size"], 1)
    if "expert_tensor_parallel_size" in section:
        etp = _int("expert_tensor_parallel_size", section["expert_tensor_parallel_size"], 1)
        if etp != 1:
            raise ConfigError(f"config key '{SECTION}.expert_tensor_parallel_size' is {etp}: {ETP_REFUSED}")
        out["expert_tensor_parallel_size"] = etp
    if "preset_model" in section:
        preset = section["preset_model"]
        allowed = ("auto", *sorted(PRESETS))
        if preset is None:
            preset = "auto"
        if not isinstance(preset, str) or preset.lower() not in allowed:
            raise ConfigError(f"config key '{SECTION}.preset_model' must be one of {', '.join(allowed)}, "
                              f"got {preset!r}")
        out["preset_model"] = preset.lower()
    if "top_k" in section:
        out["top_k"] = _int("top_k", section["top_k"], 1, allow_none=True)
    if "score_func" in section:
        out["score_func"] = _choice("score_func", section["score_func"], SCORE_FUNCS)
    if "score_apply" in section:
        out["score_apply"] = _choice("score_apply", section["score_apply"], SCORE_APPLY)
    if "group_score" in section:
        out["group_score"] = _choice("group_score", section["group_score"], GROUP_SCORES)
    if "route_norm" in section:
        v = section["route_norm"]
        if v is not None and not isinstance(v, bool):
            raise ConfigError(f"config key '{SECTION}.route_norm' must be true, false or null, got {v!r}")
        out["route_norm"] = v
    if "routed_scaling_factor" in section:
        v = section["routed_scaling_factor"]
        if v is not None:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            if not ok:
                raise ConfigError(f"config key '{SECTION}.routed_scaling_factor' must be a finite number > 0 or "
                                  f"null, got {v!r}")
            v = float(v)
        out["routed_scaling_factor"] = v
    for key in ("num_expert_groups", "num_limited_groups"):
        if key in section:
            out[key] = _int(key, section[key], 1, allow_none=True)
    if (out.get("num_expert_groups") is None) != (out.get("num_limited_groups") is None):
        raise ConfigError(f"config keys '{SECTION}.num_expert_groups' and '{SECTION}.num_limited_groups' go "
                          "together (group-limited routing): set both or neither")
    if out.get("num_expert_groups") is not None and out["num_limited_groups"] > out["num_expert_groups"]:
        raise ConfigError(f"config key '{SECTION}.num_limited_groups' ({out['num_limited_groups']}) must not "
                          f"exceed '{SECTION}.num_expert_groups' ({out['num_expert_groups']})")
    if "moe_layer_pattern" in section:
        pat = _name("moe_layer_pattern", section["moe_layer_pattern"])
        if pat is not None:
            try:
                re.compile(pat)
            except re.error as exc:
                raise ConfigError(f"config key '{SECTION}.moe_layer_pattern' is not a valid regular expression "
                                  f"({exc}): {pat!r}") from None
        out["moe_layer_pattern"] = pat
    for key in ("router_pattern", "expert_pattern", "expert_w1", "expert_w2", "expert_w3", "num_experts_attr",
                "top_k_attr", "shared_expert_pattern", "shared_expert_gate_pattern"):
        if key in section:
            out[key] = _name(key, section[key])
    ws = [out.get(k) for k in ("expert_w1", "expert_w2", "expert_w3")]
    if any(w is not None for w in ws) and not all(w is not None for w in ws):
        raise ConfigError(f"config keys '{SECTION}.expert_w1', 'expert_w2' and 'expert_w3' go together (the "
                          "per-expert gate, down and up projections): set all three or none")
    return AutoEPConfig(**out)


def mesh_sizes(section: Any) -> dict[str, int]:
    cfg = parse_config(section)
    return {"expert": cfg.autoep_size if cfg.enabled else 1}
