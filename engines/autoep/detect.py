"""Find the MoE blocks of a model from its module structure, and build the expert-parallel plan.

A MoE block is a module with an experts child (``experts`` unless ``expert_pattern`` names
another) and a router child (``gate`` or ``router``, or ``router_pattern``). The experts are
either

- transformers >= 5 fused 3-D parameters: ``gate_up_proj`` [E, 2F, H] and ``down_proj``
  [E, H, F] (or the transposed [E, H, 2F] / [E, F, H] when the module says
  ``is_transposed``), gate and up concatenated, no biases, SiLU; or
- an ``nn.ModuleList`` of per-expert MLPs with three bias-free linears (gate, up, down:
  ``gate_proj``/``up_proj``/``down_proj``, ``w1``/``w3``/``w2``, or ``expert_w1/w3/w2``).

The expert count is read from the model config (the family's attribute, or
``num_experts_attr``) and cross-checked against the router weight's rows and the experts'
first dimension. Shared experts (``shared_expert``/``shared_experts``) and Qwen's sigmoid
``shared_expert_gate`` are found the same way; a router's ``e_score_correction_bias`` turns on
DeepSeek-V3's biased choice. Modules that look like feed-forward layers
(``layers.N.mlp`` and the like, or whatever ``moe_layer_pattern`` matches) but have no experts
are dense and left alone.

Everything here only reads the model: errors are raised before any weight changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from polyaccel.errors import ConfigError

from .config import SECTION, AutoEPConfig
from .expert_layouts import FUSED, FUSED_T, MODULE_LIST, LayoutError, children, read_experts  # noqa: F401 - re-exports
from .presets import GENERIC_NUM_EXPERTS_ATTRS, GENERIC_TOP_K_ATTRS, MODEL_TYPES, PRESETS, Preset, Routing

EXPERT_NAMES = ("experts",)
ROUTER_NAMES = ("gate", "router")
SHARED_NAMES = ("shared_expert", "shared_experts")
SHARED_GATE_NAMES = ("shared_expert_gate",)
#: names of feed-forward blocks listed as dense when they have no experts (default detection)
DENSE_HINT = re.compile(r"(.*\.)?(layers|h|blocks)\.\d+\.(mlp|block_sparse_moe|feed_forward|moe|ffn)")


@dataclass(frozen=True)
class MoELayerSpec:
    """One detected MoE block."""

    name: str
    block_class: str
    layout: str  # FUSED | FUSED_T | MODULE_LIST
    experts_name: str
    router_name: str
    router_class: str
    num_experts: int
    hidden_size: int
    ffn_size: int
    routing: Routing
    shared_name: str | None = None
    shared_gate_name: str | None = None
    projections: tuple[str, str, str] | None = None  # ModuleList: (gate, down, up) child names
    jitter_noise: float = 0.0
    returns_router_logits: bool = False  # the block returns (hidden, router_logits)
    flat_output: bool = False  # the block returns [T, H] for a [B, S, H] input

    def experts_of(self, ep: int, rank: int) -> range:
        n = self.num_experts // ep
        return range(rank * n, (rank + 1) * n)


@dataclass
class EPPlan:
    """What AutoEP does (or would do) to a model: printable as a table."""

    model_class: str
    model_type: str | None
    preset: str | None
    ep_size: int
    layers: list[MoELayerSpec]
    dense: list[tuple[str, str]] = field(default_factory=list)  # (name, class) left alone
    expert_data: int | None = None  # replicas of each expert shard (None: not on a mesh)
    capture_graphs: bool | str = "auto"  # the layers replay their routed experts from device graphs (True, "auto")

    def expert_range(self, layer: MoELayerSpec, rank: int) -> range:
        return layer.experts_of(self.ep_size, rank)

    def param_counts(self) -> tuple[int, int]:
        """(expert parameters per EP rank, expert parameters in the whole model)."""
        total = sum(3 * s.num_experts * s.ffn_size * s.hidden_size for s in self.layers)
        return total // self.ep_size, total

    def __str__(self) -> str:
        lines = []
        head = f"AutoEP plan for {self.model_class}"
        if self.model_type:
            head += f" (model_type {self.model_type!r}, preset {self.preset or 'none: explicit routing knobs'})"
        mesh = f"ep={self.ep_size}"
        if self.expert_data is not None:
            mesh += f", expert_data={self.expert_data}"
        if self.capture_graphs is True:
            mesh += ", routed experts replayed from device graphs"
        lines.append(f"{head}: {mesh}, {len(self.layers)} MoE layer(s), {len(self.dense)} dense layer(s) left alone")
        rows = [("layer", "experts", "per rank", "layout", "routing", "shared")]
        for names, s in _runs(self.layers):
            n = s.num_experts // self.ep_size
            shown = list(range(self.ep_size)) if self.ep_size <= 4 else [0, 1, None, self.ep_size - 1]
            ranks = " ".join("..." if r is None else f"r{r}:{r * n}-{(r + 1) * n - 1}" for r in shown)
            shared = s.shared_name or "-"
            if s.shared_gate_name:
                shared += f" (+sigmoid {s.shared_gate_name})"
            rows.append((names, f"{s.num_experts} x [{s.hidden_size}->{s.ffn_size}]", f"{n}  {ranks}",
                         s.layout, s.routing.describe(), shared))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if self.dense:
            lines.append("  dense (no experts, left alone): "
                         + ", ".join(f"{n} ({c})" for n, c in self.dense[:6])
                         + (f" ... {len(self.dense) - 6} more" if len(self.dense) > 6 else ""))
        per_rank, total = self.param_counts()
        lines.append(f"  expert parameters: {per_rank:,} per EP rank of {total:,}; router and shared-expert "
                     "parameters replicated over data")
        return "\n".join(lines)


_NUM = re.compile(r"\.(\d+)\.")


def _runs(layers: list[MoELayerSpec]):
    """Consecutive layers that differ only in their layer number, as ("a.3-60.b (58 layers)", spec)."""
    out: list[list] = []
    for s in layers:
        m = _NUM.search(s.name)
        key = (_NUM.sub(".#.", s.name, count=1), s.num_experts, s.hidden_size, s.ffn_size, s.layout, s.routing,
               s.shared_name, s.shared_gate_name)
        idx = int(m.group(1)) if m else None
        if out and m and out[-1][0] == key and out[-1][3] == idx - 1:
            out[-1][3] = idx
            out[-1][4] += 1
        else:
            out.append([key, s, idx, idx, 1])
    for key, s, first, last, count in out:
        if count == 1:
            yield s.name, s
        else:
            yield key[0].replace("#", f"{first}-{last}", 1) + f" ({count} layers)", s


def _model_config(model):
    return getattr(model, "config", None)


def _resolve_preset(model, cfg: AutoEPConfig) -> tuple[Preset | None, str | None]:
    model_type = getattr(_model_config(model), "model_type", None)
    if cfg.preset_model != "auto":
        return PRESETS[cfg.preset_model], model_type
    return MODEL_TYPES.get(model_type), model_type


def _names(override: str | None, defaults: tuple[str, ...]) -> tuple[str, ...]:
    """The names to look for: the configured one alone, else the defaults."""
    return (override,) if override else defaults


def _first_int_attr(obj, attrs: tuple[str, ...]) -> tuple[int | None, str | None]:
    """(value, name) of the first of ``attrs`` that ``obj`` holds as an integer (a bool is not one)."""
    if obj is None:
        return None, None
    for a in attrs:
        v = getattr(obj, a, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v, a
    return None, None


def _find_router(where: str, kids: dict, cfg: AutoEPConfig, experts_name: str):
    """(name, module, weight [num_experts, hidden]) of the block's linear router."""
    router_names = _names(cfg.router_pattern, ROUTER_NAMES)
    router_name = next((n for n in router_names if n in kids), None)
    if router_name is None:
        raise LayoutError(f"{where} has an experts child {experts_name!r} but no router child (looked for "
                          f"{', '.join(router_names)}; children: {sorted(kids)}); set '{SECTION}.router_pattern' to "
                          f"the router's name or '{SECTION}.moe_layer_pattern' to leave this module out")
    router = kids[router_name]
    rw = getattr(router, "weight", None)
    if not isinstance(rw, torch.Tensor) or rw.dim() != 2:
        raise LayoutError(f"{where}: router {router_name!r} ({type(router).__name__}) has no 2-D weight "
                          "[num_experts, hidden]; AutoEP needs a linear router")
    return router_name, router, rw


def _num_experts(where: str, model_config, preset: Preset | None, cfg: AutoEPConfig, router_name: str,
                 E_router: int, E_experts: int) -> int:
    """The expert count, where the model config (when it says), the router rows and the experts all agree."""
    attrs = _names(cfg.num_experts_attr, preset.num_experts_attrs if preset else GENERIC_NUM_EXPERTS_ATTRS)
    E_cfg, attr_used = _first_int_attr(model_config, attrs)
    if cfg.num_experts_attr and E_cfg is None:
        raise ConfigError(f"'{SECTION}.num_experts_attr' is {cfg.num_experts_attr!r} but the model config has no "
                          "integer attribute of that name")
    if E_cfg is not None and not (E_cfg == E_router == E_experts):
        raise ConfigError(f"{where}: expert counts disagree: model config {attr_used}={E_cfg}, router "
                          f"{router_name}.weight has {E_router} rows, experts hold {E_experts}; fix the config (or "
                          f"set '{SECTION}.num_experts_attr')")
    if E_router != E_experts:
        raise ConfigError(f"{where}: router {router_name}.weight has {E_router} rows but the experts hold {E_experts}")
    return E_experts


def _top_k(where: str, router, block, model_config, cfg: AutoEPConfig, E: int) -> int:
    """Experts per token: config knob > router attribute > model config > block attribute."""
    top_k = cfg.top_k
    if top_k is None:
        top_k = getattr(router, "top_k", None)
    if top_k is None:
        top_k, _ = _first_int_attr(model_config, _names(cfg.top_k_attr, GENERIC_TOP_K_ATTRS))
    if top_k is None:
        top_k = getattr(block, "top_k", None)
    if not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"{where}: cannot tell top-k (no router.top_k, no model config num_experts_per_tok); set "
                          f"'{SECTION}.top_k' or '{SECTION}.top_k_attr'")
    if top_k > E:
        raise ConfigError(f"{where}: top_k={top_k} exceeds its {E} experts")
    return top_k


def _has_correction_bias(where: str, router, router_name: str, preset: Preset | None, E: int) -> bool:
    """Whether the router carries DeepSeek-V3's ``e_score_correction_bias`` [E] (required by some presets)."""
    bias = getattr(router, "e_score_correction_bias", None)
    has_bias = isinstance(bias, torch.Tensor)
    if has_bias and tuple(bias.shape) != (E,):
        raise LayoutError(f"{where}: {router_name}.e_score_correction_bias has shape {list(bias.shape)}, "
                          f"expected [{E}]")
    if preset is not None and preset.needs_correction_bias and not has_bias:
        raise LayoutError(f"{where}: preset {preset.name!r} expects {router_name}.e_score_correction_bias, not found")
    return has_bias


def _routing_knobs(cfg: AutoEPConfig) -> dict:
    """The routing keys the config sets (not left to the family)."""
    knobs = {key: getattr(cfg, key) for key in ("score_func", "score_apply", "group_score")
             if getattr(cfg, key) != "auto"}
    knobs.update({key: getattr(cfg, key) for key in ("route_norm", "routed_scaling_factor", "num_expert_groups",
                                                      "num_limited_groups") if getattr(cfg, key) is not None})
    return knobs


def _check_groups(name: str, groups: int, limited: int, group_score: str, top_k: int, E: int) -> None:
    """Group-limited routing fits the layer: groups divide the experts and hold at least top-k of them."""
    if E % groups:
        raise ConfigError(f"{name}: num_expert_groups={groups} does not divide its {E} experts")
    if limited > groups:
        raise ConfigError(f"{name}: num_limited_groups={limited} exceeds num_expert_groups={groups}")
    if group_score == "top2_sum" and E // groups < 2:
        raise ConfigError(f"{name}: group_score 'top2_sum' needs at least 2 experts per group, got {E // groups}")
    if top_k > limited * (E // groups):
        raise ConfigError(f"{name}: top_k={top_k} exceeds the {limited * (E // groups)} experts of "
                          f"{limited} limited group(s)")


def _routing(name: str, preset: Preset | None, model_type, router, model_config, cfg: AutoEPConfig,
             top_k: int, E: int, has_bias: bool) -> Routing:
    base = preset.defaults(router, model_config) if preset is not None else {}
    merged = {**base, **_routing_knobs(cfg)}
    missing = [k for k in ("score_func", "route_norm") if k not in merged]
    if missing:
        raise ConfigError(
            f"{name}: found a MoE block, but model_type {model_type!r} has no AutoEP routing preset, so its routing "
            f"rule is unknown; set '{SECTION}.preset_model' to one of {', '.join(sorted(PRESETS))} or set "
            f"'{SECTION}.score_func' and '{SECTION}.route_norm' (and routed_scaling_factor, num_expert_groups / "
            "num_limited_groups where the family uses them)")
    groups = merged.get("num_expert_groups")
    limited = merged.get("num_limited_groups")
    group_score = merged.get("group_score", "top2_sum")
    if group_score == "auto":
        group_score = "top2_sum"
    if groups is not None:
        _check_groups(name, groups, limited, group_score, top_k, E)
    score_apply = merged.get("score_apply", "post")
    return Routing(top_k=top_k, score_func=merged["score_func"], score_apply=score_apply,
                   route_norm=bool(merged["route_norm"]), scale=float(merged.get("routed_scaling_factor", 1.0)),
                   num_groups=groups, limited_groups=limited, group_score=group_score, correction_bias=has_bias)


def _optional_child(where: str, kids: dict, key: str, override: str | None, defaults: tuple[str, ...]) -> str | None:
    """The first of the names present; a configured name (config key ``key``) must be present."""
    found = next((n for n in _names(override, defaults) if n in kids), None)
    if override and found is None:
        raise ConfigError(f"'{SECTION}.{key}' is {override!r} but {where} has no such child (children: "
                          f"{sorted(kids)})")
    return found


def _shared_experts(where: str, kids: dict, cfg: AutoEPConfig, H: int) -> tuple[str | None, str | None]:
    """(shared expert, its sigmoid gate) child names, each None when absent; a gate needs a shared expert."""
    shared = _optional_child(where, kids, "shared_expert_pattern", cfg.shared_expert_pattern, SHARED_NAMES)
    shared_gate = _optional_child(where, kids, "shared_expert_gate_pattern", cfg.shared_expert_gate_pattern,
                                  SHARED_GATE_NAMES)
    if shared_gate is not None:
        g = kids[shared_gate]
        if not isinstance(g, torch.nn.Linear) or g.out_features != 1 or g.in_features != H:
            raise LayoutError(f"{where}: {shared_gate} should be an nn.Linear({H}, 1) (the shared expert's sigmoid "
                              f"gate), found {g}")
        if shared is None:
            raise LayoutError(f"{where} has a shared-expert gate {shared_gate!r} but no shared expert "
                              f"(looked for {', '.join(_names(cfg.shared_expert_pattern, SHARED_NAMES))})")
    return shared, shared_gate


def _check_known_children(where: str, kids: dict, experts_name: str, router_name: str, shared: str | None,
                          shared_gate: str | None) -> None:
    """Every child with parameters is one AutoEP runs: a converted block would silently drop the others."""
    known = {experts_name, router_name, shared, shared_gate} - {None}
    extra = [n for n, m in kids.items() if n not in known and any(True for _ in m.parameters())]
    if extra:
        raise LayoutError(f"{where} has children AutoEP does not know how to run: {extra} (known: router "
                          f"{router_name!r}, experts {experts_name!r}, shared expert, shared-expert gate); set "
                          f"'{SECTION}.shared_expert_pattern' if one is a shared expert, or "
                          f"'{SECTION}.moe_layer_pattern' to leave this module out")


def _probe_output(block, H: int, device, dtype) -> tuple[bool, bool]:
    """(returns_router_logits, flat_output) from one no-grad call on two zero tokens (eval mode)."""
    if device.type == "meta":
        return False, False
    was_training = block.training
    block.eval()
    try:
        with torch.no_grad():
            out = block(torch.zeros(1, 2, H, device=device, dtype=dtype))
    except Exception:  # noqa: BLE001 - an unusual forward: assume the transformers-5 contract
        return False, False
    finally:
        block.train(was_training)
    if isinstance(out, tuple):
        hidden = out[0]
        return len(out) > 1, isinstance(hidden, torch.Tensor) and hidden.dim() == 2
    return False, out.dim() == 2


def _layer_spec(name: str, block, model, cfg: AutoEPConfig, preset, model_type, experts_name: str):
    """Read one MoE block, in the order its parts depend on each other: router (hidden size), experts,
    expert count, top-k, routing, shared experts; then probe what its forward returns."""
    kids = children(block)
    where = f"{name} ({type(block).__name__})"
    router_name, router, rw = _find_router(where, kids, cfg, experts_name)
    E_router, H = rw.shape
    experts = read_experts(name, kids[experts_name], H, cfg)
    model_config = _model_config(model)
    E = _num_experts(where, model_config, preset, cfg, router_name, E_router, experts.num_experts)
    top_k = _top_k(where, router, block, model_config, cfg, E)
    has_bias = _has_correction_bias(where, router, router_name, preset, E)
    routing = _routing(where, preset, model_type, router, model_config, cfg, top_k, E, has_bias)
    shared, shared_gate = _shared_experts(where, kids, cfg, H)
    _check_known_children(where, kids, experts_name, router_name, shared, shared_gate)
    returns_logits, flat = _probe_output(block, H, rw.device, experts.dtype)
    return MoELayerSpec(
        name=name, block_class=type(block).__name__, layout=experts.layout, experts_name=experts_name,
        router_name=router_name, router_class=type(router).__name__, num_experts=E, hidden_size=H,
        ffn_size=experts.ffn_size, routing=routing, shared_name=shared, shared_gate_name=shared_gate,
        projections=experts.projections, jitter_noise=float(getattr(block, "jitter_noise", 0.0) or 0.0),
        returns_router_logits=returns_logits, flat_output=flat)


def _candidate_blocks(model: torch.nn.Module, cfg: AutoEPConfig, experts_names: tuple[str, ...]) -> list:
    """(name, module) of the modules to read as MoE blocks or list as dense: those ``moe_layer_pattern``
    matches, else those with an experts child or a feed-forward name (:data:`DENSE_HINT`)."""
    modules = list(model.named_modules())
    if not cfg.moe_layer_pattern:
        return [(n, m) for n, m in modules
                if n and (any(e in children(m) for e in experts_names) or DENSE_HINT.fullmatch(n))]
    pat = re.compile(cfg.moe_layer_pattern)
    candidates = [(n, m) for n, m in modules if n and pat.fullmatch(n)]
    if not candidates:
        sample = [n for n, _ in modules if n and DENSE_HINT.fullmatch(n)][:4] or [n for n, _ in modules[1:5]]
        raise ConfigError(f"'{SECTION}.moe_layer_pattern' {cfg.moe_layer_pattern!r} matches no module of "
                          f"{type(model).__name__} (module names look like: {', '.join(sample)}); it must match "
                          "whole names (re.fullmatch)")
    return candidates


def _no_moe_block(model: torch.nn.Module, cfg: AutoEPConfig, experts_names: tuple[str, ...],
                  dense: list[tuple[str, str]]) -> LayoutError:
    how = (f"modules matching {cfg.moe_layer_pattern!r}" if cfg.moe_layer_pattern
           else f"modules with a child named {' or '.join(map(repr, experts_names))}")
    found = f"; feed-forward modules found: {', '.join(n for n, _ in dense[:4])}" if dense else ""
    return LayoutError(f"no MoE block found in {type(model).__name__} (looked for {how}{found}); set "
                       f"'{SECTION}.expert_pattern' to the experts' child name and/or '{SECTION}.moe_layer_pattern' "
                       "to the MoE blocks' names")


def _check_expert_degree(layers: list[MoELayerSpec], ep: int) -> None:
    for s in layers:
        if s.num_experts % ep:
            divisors = [d for d in range(1, s.num_experts + 1) if s.num_experts % d == 0]
            raise ConfigError(f"'{SECTION}.autoep_size'={ep} does not divide the {s.num_experts} experts of {s.name}; "
                              f"choose one of {', '.join(map(str, divisors))}")


def detect(model: torch.nn.Module, cfg: AutoEPConfig, ep_size: int | None = None,
           expert_data: int | None = None) -> EPPlan:
    """The plan for ``model``: every MoE block found, validated for ``ep_size`` (default ``cfg.autoep_size``)."""
    ep = cfg.autoep_size if ep_size is None else ep_size
    preset, model_type = _resolve_preset(model, cfg)
    experts_names = _names(cfg.expert_pattern, EXPERT_NAMES)
    layers, dense = [], []
    for name, block in _candidate_blocks(model, cfg, experts_names):
        kids = children(block)
        experts_name = next((e for e in experts_names if e in kids), None)
        if experts_name is None:
            dense.append((name, type(block).__name__))
        else:
            layers.append(_layer_spec(name, block, model, cfg, preset, model_type, experts_name))
    if not layers:
        raise _no_moe_block(model, cfg, experts_names, dense)
    _check_expert_degree(layers, ep)
    return EPPlan(model_class=type(model).__name__, model_type=model_type, preset=preset.name if preset else None,
                  ep_size=ep, layers=layers, dense=dense, expert_data=expert_data, capture_graphs=cfg.capture_graphs)
