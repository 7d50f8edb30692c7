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
from .presets import GENERIC_NUM_EXPERTS_ATTRS, GENERIC_TOP_K_ATTRS, MODEL_TYPES, PRESETS, Preset, Routing

EXPERT_NAMES = ("experts",)
ROUTER_NAMES = ("gate", "router")
SHARED_NAMES = ("shared_expert", "shared_experts")
SHARED_GATE_NAMES = ("shared_expert_gate",)
MODULE_LIST_PROJECTIONS = (("gate_proj", "down_proj", "up_proj"), ("w1", "w2", "w3"))  # (gate, down, up)
#: names of feed-forward blocks listed as dense when they have no experts (default detection)
DENSE_HINT = re.compile(r"(.*\.)?(layers|h|blocks)\.\d+\.(mlp|block_sparse_moe|feed_forward|moe|ffn)")
FUSED, FUSED_T, MODULE_LIST = "fused 3-D", "fused 3-D transposed", "ModuleList"


class LayoutError(ConfigError):
    """A MoE block whose layout AutoEP does not recognise; the message says what was found."""


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


def _children(module) -> dict:
    return dict(module.named_children())


def _is_silu(act) -> bool:
    return act is not None and type(act).__name__ in ("SiLU", "SiLUActivation", "SwishActivation")


def _describe_params(module, limit: int = 6) -> str:
    items = [f"{n} {list(p.shape)}" for n, p in list(module.named_parameters())[:limit]]
    return ", ".join(items) or "no parameters"


def _model_config(model):
    return getattr(model, "config", None)


def _resolve_preset(model, cfg: AutoEPConfig) -> tuple[Preset | None, str | None]:
    model_type = getattr(_model_config(model), "model_type", None)
    if cfg.preset_model != "auto":
        return PRESETS[cfg.preset_model], model_type
    return MODEL_TYPES.get(model_type), model_type


def _fused_layout(name: str, experts, H: int, cfg: AutoEPConfig) -> tuple[str, int, int]:
    """(layout, num_experts, ffn) of transformers-5 fused experts; raises LayoutError otherwise."""
    gu = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    where = f"{name}.experts ({type(experts).__name__})"
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor) or gu.dim() != 3 or down.dim() != 3:
        raise LayoutError(
            f"{where} is neither fused 3-D experts (gate_up_proj [E, 2F, H] and down_proj [E, H, F], "
            f"transformers >= 5) nor a ModuleList of per-expert MLPs; found {_describe_params(experts)}. "
            f"Set '{SECTION}.expert_pattern' to the experts child, '{SECTION}.expert_w1/expert_w2/expert_w3' to a "
            f"ModuleList expert's gate/down/up projections, or '{SECTION}.moe_layer_pattern' to leave this "
            "module out")
    unsupported = []
    if getattr(experts, "has_bias", False) or any(n.endswith("_bias") for n, _ in experts.named_parameters()):
        unsupported.append("expert biases")
    if not getattr(experts, "has_gate", True):
        unsupported.append("no gate projection (not a gated MLP)")
    if not getattr(experts, "is_concatenated", True):
        unsupported.append("interleaved gate/up columns")
    if getattr(experts, "has_post_expert_norm", False):
        unsupported.append("a post-expert norm")
    act = getattr(experts, "act_fn", None)
    if act is not None and not _is_silu(act):
        unsupported.append(f"activation {type(act).__name__} (AutoEP runs SwiGLU: SiLU)")
    if unsupported:
        raise LayoutError(f"{where}: fused experts with {', '.join(unsupported)} are not supported by AutoEP; "
                          f"set '{SECTION}.moe_layer_pattern' to leave this module out")
    transposed = bool(getattr(experts, "is_transposed", False))
    E = gu.shape[0]
    if transposed:
        h_in, two_f = gu.shape[1], gu.shape[2]
        f_d, h_out = down.shape[1], down.shape[2]
    else:
        two_f, h_in = gu.shape[1], gu.shape[2]
        h_out, f_d = down.shape[1], down.shape[2]
    if two_f % 2 or h_in != H or h_out != H or f_d != two_f // 2 or down.shape[0] != E:
        orient = "[E, H, 2F] / [E, F, H] (is_transposed)" if transposed else "[E, 2F, H] / [E, H, F]"
        raise LayoutError(f"{where}: gate_up_proj {list(gu.shape)} and down_proj {list(down.shape)} do not fit the "
                          f"{orient} layout with hidden size {H} (from the router weight)")
    return (FUSED_T if transposed else FUSED), E, two_f // 2


def _module_list_layout(name: str, experts, H: int, cfg: AutoEPConfig):
    where = f"{name}.experts"
    if len(experts) == 0:
        raise LayoutError(f"{where} is an empty ModuleList")
    first = experts[0]
    kids = _children(first)
    if cfg.expert_w1:
        candidates = ((cfg.expert_w1, cfg.expert_w2, cfg.expert_w3),)
    else:
        candidates = MODULE_LIST_PROJECTIONS
    proj = next((c for c in candidates if all(isinstance(kids.get(n), torch.nn.Linear) for n in c)), None)
    if proj is None:
        tried = " or ".join("/".join(c) for c in candidates)
        raise LayoutError(
            f"{where}[0] ({type(first).__name__}) has children {sorted(kids) or 'none'} ({_describe_params(first)}); "
            f"AutoEP looked for three nn.Linear projections named {tried} (gate/down/up). Set "
            f"'{SECTION}.expert_w1', 'expert_w2' and 'expert_w3' to the gate, down and up projection names")
    g, d, u = proj
    F = kids[g].out_features
    for i, e in enumerate(experts):
        ek = _children(e)
        for n, (fin, fout) in ((g, (H, F)), (u, (H, F)), (d, (F, H))):
            lin = ek.get(n)
            if not isinstance(lin, torch.nn.Linear) or (lin.in_features, lin.out_features) != (fin, fout):
                raise LayoutError(f"{where}[{i}].{n} is not an nn.Linear({fin}, {fout}) like expert 0's "
                                  "(experts must share one shape)")
            if lin.bias is not None:
                raise LayoutError(f"{where}[{i}].{n} has a bias; AutoEP's grouped experts have none")
        act = getattr(e, "act_fn", None)
        if act is not None and not _is_silu(act):
            raise LayoutError(f"{where}[{i}] uses activation {type(act).__name__}; AutoEP runs SwiGLU (SiLU)")
    return MODULE_LIST, len(experts), F, proj


def _routing(name: str, preset: Preset | None, model_type, router, model_config, cfg: AutoEPConfig,
             top_k: int, E: int, has_bias: bool) -> Routing:
    base = preset.defaults(router, model_config) if preset is not None else {}
    knobs = {}
    for key in ("score_func", "score_apply", "group_score"):
        v = getattr(cfg, key)
        if v != "auto":
            knobs[key] = v
    for key in ("route_norm", "routed_scaling_factor", "num_expert_groups", "num_limited_groups"):
        v = getattr(cfg, key)
        if v is not None:
            knobs[key] = v
    merged = {**base, **knobs}
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
        if E % groups:
            raise ConfigError(f"{name}: num_expert_groups={groups} does not divide its {E} experts")
        if limited > groups:
            raise ConfigError(f"{name}: num_limited_groups={limited} exceeds num_expert_groups={groups}")
        if group_score == "top2_sum" and E // groups < 2:
            raise ConfigError(f"{name}: group_score 'top2_sum' needs at least 2 experts per group, got {E // groups}")
        if top_k > limited * (E // groups):
            raise ConfigError(f"{name}: top_k={top_k} exceeds the {limited * (E // groups)} experts of "
                              f"{limited} limited group(s)")
    score_apply = merged.get("score_apply", "post")
    return Routing(top_k=top_k, score_func=merged["score_func"], score_apply=score_apply,
                   route_norm=bool(merged["route_norm"]), scale=float(merged.get("routed_scaling_factor", 1.0)),
                   num_groups=groups, limited_groups=limited, group_score=group_score, correction_bias=has_bias)


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
    kids = _children(block)
    experts = kids[experts_name]
    where = f"{name} ({type(block).__name__})"
    router_names = (cfg.router_pattern,) if cfg.router_pattern else ROUTER_NAMES
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
    E_router, H = rw.shape
    projections = None
    if isinstance(experts, torch.nn.ModuleList):
        layout, E_exp, F, projections = _module_list_layout(name, experts, H, cfg)
    else:
        layout, E_exp, F = _fused_layout(name, experts, H, cfg)
    model_config = _model_config(model)
    attrs = (cfg.num_experts_attr,) if cfg.num_experts_attr else (
        preset.num_experts_attrs if preset else GENERIC_NUM_EXPERTS_ATTRS)
    E_cfg, attr_used = None, None
    for a in attrs:
        v = getattr(model_config, a, None) if model_config is not None else None
        if isinstance(v, int) and not isinstance(v, bool):
            E_cfg, attr_used = v, a
            break
    if cfg.num_experts_attr and E_cfg is None:
        raise ConfigError(f"'{SECTION}.num_experts_attr' is {cfg.num_experts_attr!r} but the model config has no "
                          "integer attribute of that name")
    if E_cfg is not None and not (E_cfg == E_router == E_exp):
        raise ConfigError(f"{where}: expert counts disagree: model config {attr_used}={E_cfg}, router "
                          f"{router_name}.weight has {E_router} rows, experts hold {E_exp}; fix the config (or set "
                          f"'{SECTION}.num_experts_attr')")
    if E_router != E_exp:
        raise ConfigError(f"{where}: router {router_name}.weight has {E_router} rows but the experts hold {E_exp}")
    E = E_exp
    # top-k: config knob > router attribute > model config > block attribute
    top_k = cfg.top_k
    if top_k is None:
        top_k = getattr(router, "top_k", None)
    if top_k is None and model_config is not None:
        for a in ((cfg.top_k_attr,) if cfg.top_k_attr else GENERIC_TOP_K_ATTRS):
            v = getattr(model_config, a, None)
            if isinstance(v, int) and not isinstance(v, bool):
                top_k = v
                break
    if top_k is None:
        top_k = getattr(block, "top_k", None)
    if not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"{where}: cannot tell top-k (no router.top_k, no model config num_experts_per_tok); set "
                          f"'{SECTION}.top_k' or '{SECTION}.top_k_attr'")
    if top_k > E:
        raise ConfigError(f"{where}: top_k={top_k} exceeds its {E} experts")
    bias = getattr(router, "e_score_correction_bias", None)
    has_bias = isinstance(bias, torch.Tensor)
    if has_bias and tuple(bias.shape) != (E,):
        raise LayoutError(f"{where}: {router_name}.e_score_correction_bias has shape {list(bias.shape)}, "
                          f"expected [{E}]")
    if preset is not None and preset.needs_correction_bias and not has_bias:
        raise LayoutError(f"{where}: preset {preset.name!r} expects {router_name}.e_score_correction_bias, not found")
    routing = _routing(where, preset, model_type, router, model_config, cfg, top_k, E, has_bias)
    shared_names = (cfg.shared_expert_pattern,) if cfg.shared_expert_pattern else SHARED_NAMES
    shared = next((n for n in shared_names if n in kids), None)
    if cfg.shared_expert_pattern and shared is None:
        raise ConfigError(f"'{SECTION}.shared_expert_pattern' is {cfg.shared_expert_pattern!r} but {where} has no "
                          f"such child (children: {sorted(kids)})")
    gate_names = (cfg.shared_expert_gate_pattern,) if cfg.shared_expert_gate_pattern else SHARED_GATE_NAMES
    shared_gate = next((n for n in gate_names if n in kids), None)
    if cfg.shared_expert_gate_pattern and shared_gate is None:
        raise ConfigError(f"'{SECTION}.shared_expert_gate_pattern' is {cfg.shared_expert_gate_pattern!r} but {where} "
                          f"has no such child (children: {sorted(kids)})")
    if shared_gate is not None:
        g = kids[shared_gate]
        if not isinstance(g, torch.nn.Linear) or g.out_features != 1 or g.in_features != H:
            raise LayoutError(f"{where}: {shared_gate} should be an nn.Linear({H}, 1) (the shared expert's sigmoid "
                              f"gate), found {g}")
        if shared is None:
            raise LayoutError(f"{where} has a shared-expert gate {shared_gate!r} but no shared expert "
                              f"(looked for {', '.join(shared_names)})")
    known = {experts_name, router_name, shared, shared_gate} - {None}
    extra = [n for n, m in kids.items() if n not in known and any(True for _ in m.parameters())]
    if extra:
        raise LayoutError(f"{where} has children AutoEP does not know how to run: {extra} (known: router "
                          f"{router_name!r}, experts {experts_name!r}, shared expert, shared-expert gate); set "
                          f"'{SECTION}.shared_expert_pattern' if one is a shared expert, or "
                          f"'{SECTION}.moe_layer_pattern' to leave this module out")
    if isinstance(experts, torch.nn.ModuleList):
        dtype = experts[0].get_submodule(projections[0]).weight.dtype
    else:
        dtype = experts.gate_up_proj.dtype
    returns_logits, flat = _probe_output(block, H, rw.device, dtype)
    return MoELayerSpec(
        name=name, block_class=type(block).__name__, layout=layout, experts_name=experts_name,
        router_name=router_name, router_class=type(router).__name__, num_experts=E, hidden_size=H, ffn_size=F,
        routing=routing, shared_name=shared, shared_gate_name=shared_gate, projections=projections,
        jitter_noise=float(getattr(block, "jitter_noise", 0.0) or 0.0), returns_router_logits=returns_logits,
        flat_output=flat)


def detect(model: torch.nn.Module, cfg: AutoEPConfig, ep_size: int | None = None,
           expert_data: int | None = None) -> EPPlan:
    """The plan for ``model``: every MoE block found, validated for ``ep_size`` (default ``cfg.autoep_size``)."""
    ep = cfg.autoep_size if ep_size is None else ep_size
    preset, model_type = _resolve_preset(model, cfg)
    experts_names = (cfg.expert_pattern,) if cfg.expert_pattern else EXPERT_NAMES
    modules = list(model.named_modules())
    if cfg.moe_layer_pattern:
        pat = re.compile(cfg.moe_layer_pattern)
        candidates = [(n, m) for n, m in modules if n and pat.fullmatch(n)]
        if not candidates:
            sample = [n for n, _ in modules if n and DENSE_HINT.fullmatch(n)][:4] or [n for n, _ in modules[1:5]]
            raise ConfigError(f"'{SECTION}.moe_layer_pattern' {cfg.moe_layer_pattern!r} matches no module of "
                              f"{type(model).__name__} (module names look like: {', '.join(sample)}); it must match "
                              "whole names (re.fullmatch)")
    else:
        candidates = [(n, m) for n, m in modules
                      if n and (any(e in _children(m) for e in experts_names) or DENSE_HINT.fullmatch(n))]
    layers, dense = [], []
    for name, block in candidates:
        kids = _children(block)
        experts_name = next((e for e in experts_names if e in kids), None)
        if experts_name is None:
            dense.append((name, type(block).__name__))
            continue
        layers.append(_layer_spec(name, block, model, cfg, preset, model_type, experts_name))
    if not layers:
        how = (f"modules matching {cfg.moe_layer_pattern!r}" if cfg.moe_layer_pattern
               else f"modules with a child named {' or '.join(map(repr, experts_names))}")
        found = f"; feed-forward modules found: {', '.join(n for n, _ in dense[:4])}" if dense else ""
        raise LayoutError(f"no MoE block found in {type(model).__name__} (looked for {how}{found}); set "
                          f"'{SECTION}.expert_pattern' to the experts' child name and/or '{SECTION}.moe_layer_pattern' "
                          "to the MoE blocks' names")
    for s in layers:
        if s.num_experts % ep:
            divisors = [d for d in range(1, s.num_experts + 1) if s.num_experts % d == 0]
            raise ConfigError(f"'{SECTION}.autoep_size'={ep} does not divide the {s.num_experts} experts of {s.name}; "
                              f"choose one of {', '.join(map(str, divisors))}")
    return EPPlan(model_class=type(model).__name__, model_type=model_type, preset=preset.name if preset else None,
                  ep_size=ep, layers=layers, dense=dense, expert_data=expert_data)
