"""Routing families: what a model type's router does, read from the model where it says so.

The structure of a MoE block (router, experts, shared experts) is detected from the modules
(:mod:`.detect`); what detection cannot see is the routing rule. A preset gives it for a
family: the score function, whether scores are applied before or after the experts, top-k
renormalisation, the routed scaling factor and group-limited routing. Values the model
carries (``norm_topk_prob``, ``routed_scaling_factor``, ``n_group``/``topk_group`` on its
router or config) are read from it; config knobs override any of them.

Every family computes router probabilities in float32 (as transformers does), whatever the
model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Routing:
    """The routing rule of one MoE layer."""

    top_k: int
    score_func: str = "softmax"  # softmax | sigmoid (over the router logits, in float32)
    score_apply: str = "post"  # post: weight the expert outputs; pre: weight the expert inputs
    route_norm: bool = True  # renormalise the top-k weights to sum to one
    scale: float = 1.0  # routed scaling factor applied to the weights
    num_groups: int | None = None  # group-limited routing: experts in this many groups ...
    limited_groups: int | None = None  # ... and each token picks experts from this many groups
    group_score: str = "top2_sum"  # how a group is ranked: max | top2_sum (sum of its best two)
    correction_bias: bool = False  # the router's e_score_correction_bias shifts the choice (not the weights)

    def describe(self) -> str:
        parts = [f"{self.score_func} top-{self.top_k}", self.score_apply]
        parts.append("renorm" if self.route_norm else "no renorm")
        if self.scale != 1.0:
            parts.append(f"scale {self.scale:g}")
        if self.num_groups:
            parts.append(f"groups {self.limited_groups}/{self.num_groups} by {self.group_score}")
        if self.correction_bias:
            parts.append("correction bias")
        return ", ".join(parts)


def _attr(router, model_config, *names, default=None):
    for obj in (router, model_config):
        for n in names:
            v = getattr(obj, n, None) if obj is not None else None
            if v is not None:
                return v
    return default


@dataclass(frozen=True)
class Preset:
    name: str
    model_types: tuple[str, ...]
    num_experts_attrs: tuple[str, ...]
    score_func: str
    families: str  # the transformers classes it was written against (for messages and docs)
    shared_expert: bool = False
    sigmoid_shared_gate: bool = False
    grouped: bool = False  # reads n_group / topk_group
    needs_correction_bias: bool = False
    fixed_norm: bool | None = None  # None: read norm_topk_prob from the model
    notes: tuple[str, ...] = field(default=())

    def defaults(self, router, model_config) -> dict:
        """The family's routing knobs for one layer (everything but top_k)."""
        out = {"score_func": self.score_func, "score_apply": "post"}
        if self.fixed_norm is not None:
            out["route_norm"] = self.fixed_norm
        else:
            out["route_norm"] = bool(_attr(router, model_config, "norm_topk_prob", default=False))
        out["routed_scaling_factor"] = float(_attr(router, model_config, "routed_scaling_factor", default=1.0))
        if self.grouped:
            groups = _attr(router, model_config, "num_group", "n_group")
            limited = _attr(router, model_config, "topk_group")
            if groups and limited and int(groups) > 1:
                out["num_expert_groups"] = int(groups)
                out["num_limited_groups"] = int(limited)
                out["group_score"] = "top2_sum"
        return out


_MIXTRAL = Preset("mixtral", ("mixtral",), ("num_local_experts",), "softmax",
                  "MixtralSparseMoeBlock (fused experts; also the transformers-4 ModuleList layout)", fixed_norm=True)
_QWEN = ("num_experts",)
_QWEN2 = Preset("qwen2_moe", ("qwen2_moe",), _QWEN, "softmax",
                "Qwen2MoeSparseMoeBlock: shared_expert + sigmoid shared_expert_gate", shared_expert=True,
                sigmoid_shared_gate=True)
_QWEN3 = Preset("qwen3_moe", ("qwen3_moe",), _QWEN, "softmax", "Qwen3MoeSparseMoeBlock")
_OLMOE = Preset("olmoe", ("olmoe",), _QWEN, "softmax", "OlmoeSparseMoeBlock")
_DSV3 = Preset("deepseek_v3", ("deepseek_v3",), ("n_routed_experts", "num_local_experts"), "sigmoid",
               "DeepseekV3MoE: sigmoid scores, e_score_correction_bias, group-limited top-k, shared_experts",
               shared_expert=True, grouped=True, needs_correction_bias=True)
_GLM4 = Preset("glm4_moe", ("glm4_moe",), ("n_routed_experts", "num_local_experts"), "sigmoid",
               "Glm4MoeMoE: DeepSeek-V3 routing", shared_expert=True, grouped=True, needs_correction_bias=True)

PRESETS: dict[str, Preset] = {p.name: p for p in (_MIXTRAL, _QWEN2, _QWEN3, _OLMOE, _DSV3, _GLM4)}
MODEL_TYPES: dict[str, Preset] = {t: p for p in PRESETS.values() for t in p.model_types}

#: config attributes that may hold the expert count when no preset names one
GENERIC_NUM_EXPERTS_ATTRS = ("num_local_experts", "num_experts", "n_routed_experts")
GENERIC_TOP_K_ATTRS = ("num_experts_per_tok", "moe_top_k", "top_k")
