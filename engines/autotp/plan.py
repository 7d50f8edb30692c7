"""Which module is split how: the tensor-parallel plan of a model, inferred without touching it.

Where each module's rule comes from, first source first:

1. ``partition_config.layer_specs`` (the user's rules; the first matching rule wins);
2. the base plan, unless ``use_default_specs`` is false: ``preset_model`` if given, else the
   model's Hugging Face plan (``config.base_model_tp_plan``, the class and instance ``_tp_plan``),
   else name and structure heuristics (for models without a plan, e.g. GPT-2's ``Conv1D``).

The plan is the same on every rank; it records, per split module, the style and the per-rank
sizes along the split dimension (one tuple per fused sub-weight), and per attention module the
heads each rank keeps. :func:`infer_plan` raises :class:`~polyaccel.errors.ConfigError` for
everything it cannot honour (an unknown style, a rule that matches nothing, heads that cannot be
split, a column layer without its row partner) before anything is changed.
"""

from __future__ import annotations

from polyaccel.errors import ConfigError
from torch import nn

from .config import TPConfig, parse
from .model_facts import ModelView, embedding_names, features, head_counts, hf_plan, module_kind
from .plan_objects import (
    COLUMN,
    COLUMN_GATHER,
    GRAD_SUM,
    HF_STYLES,
    ROW,
    ROW_SPLIT,
    SKIP,
    SPLIT_STYLES,
    VOCAB_EMBED,
    VOCAB_HEAD,
    AttentionPlan,
    ModulePlan,
    TPPlan,
)
from .resolve import (
    base_rules,
    check_strict_mode,
    drop_placed,
    refuse_unrun_styles,
    rules_by_kind,
    tie_embeddings,
    user_rules,
)
from .sizing import size_modules


def infer_plan(model: nn.Module, tp: int, section: dict | TPConfig | None = None) -> TPPlan:
    """The plan for ``model`` at tensor-parallel degree ``tp`` (nothing is modified).

    ``section`` is the ``tensor_parallel`` config section (its ``autotp_size`` is ignored here:
    ``tp`` is used), or None for the defaults.
    """
    cfg = parse(section) if section is not None else parse({"autotp_size": tp})
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"the tensor-parallel degree must be a positive int, got {tp!r}")
    if getattr(model, "polyaccel_tp_plan", None) is not None:
        raise ConfigError("this model already has tensor parallelism applied; apply AutoTP once, to the full model")
    view = ModelView.of(model)
    notes: list[str] = []
    source, base = base_rules(cfg, view)
    user = user_rules(cfg, view)
    rules = {**base, **user}
    placed = drop_placed(view, rules, notes)
    refuse_unrun_styles(rules, user, view)
    plan = TPPlan(tp=tp, source=source, notes=notes)
    resolved = rules_by_kind(rules, view, notes)
    tied = tie_embeddings(resolved, rules, view, notes)
    check_strict_mode(cfg, rules, view)
    size_modules(view, resolved, rules, plan, tied)
    _record_parameters(view, plan, placed)
    if view.hf_cfg is not None:
        plan.vocab_size = getattr(view.hf_cfg, "vocab_size", None)
    _dropout_note(model, plan)
    return plan


def _record_parameters(view: ModelView, plan: TPPlan, placed: dict[str, str]) -> None:
    """Sort the parameters the sized modules leave: grad-summed, placed by another layer, or replicated."""
    modules = view.modules
    split_params = set()
    for m in plan.modules.values():
        if m.style in SPLIT_STYLES:
            mod = modules[m.name]
            split_params.add(id(mod.weight))
            if m.style in (COLUMN, COLUMN_GATHER, VOCAB_HEAD) and getattr(mod, "bias", None) is not None:
                split_params.add(id(mod.bias))
    gsum = []
    for m in plan.modules.values():
        if m.style == GRAD_SUM:
            gsum += [f"{m.name}.{pn}" for pn, _ in modules[m.name].named_parameters()]
    seen, replicated = set(), []
    for n, p in view.model.named_parameters():
        if id(p) in split_params or n in gsum or id(p) in seen or n in placed:
            continue
        seen.add(id(p))
        replicated.append(n)
    plan.grad_sum = tuple(gsum)
    plan.replicated = tuple(replicated)
    plan.placed = tuple(placed)


def _dropout_note(model, plan: TPPlan) -> None:
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Dropout) and mod.p > 0 and plan.tp > 1:
            plan.notes.append(f"dropout {name} (p={mod.p}) is on: tensor-parallel ranks must draw the same dropout "
                              "masks on replicated activations, which needs the same seed on every rank of a group "
                              "(exact equality with one process is only claimed with dropout off)")
            return



# the plan objects and model facts are re-exported: ``autotp.plan`` was their home before the split
__all__ = [
    "COLUMN", "COLUMN_GATHER", "GRAD_SUM", "HF_STYLES", "ROW", "ROW_SPLIT", "SKIP", "VOCAB_EMBED", "VOCAB_HEAD",
    "AttentionPlan", "ModulePlan", "TPPlan", "embedding_names", "features", "head_counts", "hf_plan", "infer_plan",
    "module_kind",
]
