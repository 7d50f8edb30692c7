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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polyaccel.config_check import Bool, Float, Int, OneOf, Regex, Rule, Section, Text
from polyaccel.errors import ConfigError

from .presets import PRESETS

SECTION = "expert_parallel"
#: the mesh dimension this section sets, and the key that sets it (named in mesh errors)
SIZE_KEYS = {"expert": "autoep_size"}
SCORE_FUNCS = ("auto", "softmax", "sigmoid")
SCORE_APPLY = ("auto", "pre", "post")
GROUP_SCORES = ("auto", "max", "top2_sum")
CAPTURE_GRAPHS = (True, False, "auto")


#: why expert weights are not split over the tensor ranks
ETP_REFUSED = (
    "splitting expert weights over the tensor ranks is not supported, only 1 (the default). With tensor "
    "parallelism, AutoEP keeps every expert whole: each tensor rank holds its expert rank's experts and runs "
    "them on the same tokens (the MoE block's input is replicated over tensor), so expert state is "
    "replicated over tensor and ZeRO partitions it over expert_data. Splitting an expert over tensor as well "
    "would cut one weight over two mesh dimensions (experts over expert, features over tensor), which a "
    "parameter's layout, the gradient norm and the checkpoint format do not describe. Use a larger "
    "autoep_size to spread the experts over more ranks instead")


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
    #: replay each layer's routed experts from device graphs: true (ep 1; what a graph cannot do is refused),
    #: false, or "auto": where they pay, eagerly elsewhere, never an error (engines/autoep/graphed.py)
    capture_graphs: bool | str = "auto"


def _check_sizes(out: dict[str, Any]) -> None:
    """Experts stay whole over tensor ranks; graphs fix every size on the path, an all-to-all's row counts
    change every step."""
    etp = out.get("expert_tensor_parallel_size", 1)
    if etp != 1:
        raise ConfigError(f"config key '{SECTION}.expert_tensor_parallel_size' is {etp}: {ETP_REFUSED}")
    if out.get("capture_graphs") is True and out.get("autoep_size", 1) > 1:
        raise ConfigError(f"config key '{SECTION}.capture_graphs' needs '{SECTION}.autoep_size' 1 (it is "
                          f"{out['autoep_size']}): a device graph fixes the rows each expert rank receives, "
                          "which the all-to-all changes every step (\"auto\", the default, runs such layers eagerly)")


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


_OPTIONAL_COUNT = Int(1, optional=True)
_NAME = Text(optional=True)

#: the keys of the section, one table per part: each key's rule, then the check across that part's keys.
#: parse_config checks the parts and their keys in this order.
_SCHEMA: tuple[tuple[dict[str, Rule], Callable[[dict[str, Any]], None]], ...] = (
    ({"enabled": Bool(), "autoep_size": Int(1), "expert_tensor_parallel_size": Int(1),
      "capture_graphs": OneOf(CAPTURE_GRAPHS)}, _check_sizes),
    ({"preset_model": OneOf(("auto", *sorted(PRESETS)), optional=True), "top_k": _OPTIONAL_COUNT,
      "score_func": OneOf(SCORE_FUNCS, optional=True), "score_apply": OneOf(SCORE_APPLY, optional=True),
      "group_score": OneOf(GROUP_SCORES, optional=True), "route_norm": Bool(optional=True),
      "routed_scaling_factor": Float(0.0, above=True, optional=True), "num_expert_groups": _OPTIONAL_COUNT,
      "num_limited_groups": _OPTIONAL_COUNT}, _check_expert_groups),
    ({"moe_layer_pattern": Regex(optional=True), **dict.fromkeys(
        ("router_pattern", "expert_pattern", "expert_w1", "expert_w2", "expert_w3", "num_experts_attr",
         "top_k_attr", "shared_expert_pattern", "shared_expert_gate_pattern"), _NAME)},
     _check_expert_projections),
)
_KEYS = tuple(key for rules, _ in _SCHEMA for key in rules)


def parse_config(section: Any) -> AutoEPConfig:
    """The validated section (``section`` itself is not modified; None is the empty section)."""
    sec = Section(section, SECTION, _KEYS)
    out: dict[str, Any] = {}
    for rules, check_together in _SCHEMA:
        out.update(sec.values(rules))
        check_together(out)
    return AutoEPConfig(**out)


def mesh_sizes(section: Any) -> dict[str, int]:
    cfg = parse_config(section)
    return {"expert": cfg.autoep_size if cfg.enabled else 1}
