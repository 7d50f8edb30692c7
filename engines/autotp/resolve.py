"""From the config and the model to one rule per module: the base plan (a preset, the model's Hugging
Face plan, or heuristics) under the user's ``layer_specs``, with every refusal raised before a size is
worked out: a pattern that matches nothing, a style AutoTP does not run, a rule on a module of the
wrong kind, a split of what another layer placed, a tied embedding split on one side only."""

from __future__ import annotations

import json
import re

from polyaccel.errors import ConfigError
from torch import nn

from .config import TPConfig
from .heuristics import heuristic_rules
from .model_facts import ModelView, hf_plan, plan_key_pattern
from .plan_objects import COLUMN, COLUMN_GATHER, GRAD_SUM, HF_STYLES, SKIP, VOCAB_EMBED, VOCAB_HEAD
from .presets import preset_specs
from .rule import Rule, spec_rule


# ------------------------------------------------------------------------------------------------ the base plan
def base_rules(cfg: TPConfig, view: ModelView) -> tuple[str, dict[str, Rule]]:
    """(where the rules come from, in words; the base plan's rule per module or bare parameter)."""
    base: dict[str, Rule] = {}
    if not cfg.use_default_specs:
        source = "partition_config only (use_default_specs: false)"
    elif cfg.preset_model:
        source = f"preset_model {cfg.preset_model!r}"
        base = _preset_rules(cfg.preset_model, view)
    else:
        hf = hf_plan(view.model)
        if hf:
            source = "the model's Hugging Face plan"
            base = _hf_plan_rules(hf, view)
        else:
            source = "name/structure heuristics (the model has no Hugging Face plan)"
            base = heuristic_rules(view.model, view.kinds, view.out_emb, view.inp_emb)
    if cfg.has_user_specs and cfg.use_default_specs:
        source = "partition_config, then " + source
    return source, base


def _preset_rules(preset: str, view: ModelView) -> dict[str, Rule]:
    specs = preset_specs(preset)
    base: dict[str, Rule] = {}
    for name in view.modules:
        for spec in specs:
            if spec.matches(name, view.model_type):
                base[name] = spec_rule(spec, f"preset:{preset}", view.kinds.get(name))
                break
    return base


def _hf_plan_rules(hf: dict[str, str], view: ModelView) -> dict[str, Rule]:
    """The Hugging Face plan against module and parameter names (the first matching key wins)."""
    compiled = [(k, plan_key_pattern(k), v) for k, v in hf.items()]
    base: dict[str, Rule] = {}
    for name in list(view.modules) + view.bare:
        if not name:
            continue
        for key, pat, style in compiled:
            if pat.fullmatch(name):
                base[name] = _hf_rule(name, key, style, view)
                break
    return base


def _hf_rule(name: str, key: str, style: str, view: ModelView) -> Rule:
    # a style on a bare parameter (a fused 3-D expert weight) is not one AutoTP runs
    internal = HF_STYLES.get(style) if name in view.modules else None
    if internal is None:
        return Rule("?" + style, "hf_plan", f"{style} ({key})")
    sub = 2 if style == "packed_colwise" else None
    if internal in (COLUMN, COLUMN_GATHER) and name == view.out_emb:
        internal = VOCAB_HEAD
    return Rule(internal, "hf_plan", style, sub)


# ------------------------------------------------------------------------------------------------ the user's rules
def user_rules(cfg: TPConfig, view: ModelView) -> dict[str, Rule]:
    """The user's rules, per module and per bare parameter (a fused expert weight is a parameter); the
    first matching rule wins. A pattern that matches nothing is refused."""
    user: dict[str, Rule] = {}
    used = {(i, j): False for i, s in enumerate(cfg.layer_specs) for j in range(len(s.compiled))}
    for name in list(view.modules) + view.bare:
        for i, spec in enumerate(cfg.layer_specs):
            hits = _pattern_hits(spec, name, view.model_type)
            if not hits:
                continue
            used.update({(i, j): True for j in hits})
            if name not in user and name in view.modules:
                user[name] = spec_rule(spec, "partition_config", view.kinds.get(name))
            elif name not in user and name in view.params:
                user[name] = Rule(SKIP if spec.partition_type == "skip" else "?" + spec.partition_type,
                                  "partition_config", spec.partition_type)
            break
    unmatched = [f"{cfg.layer_specs[i].where}.patterns[{j}] {cfg.layer_specs[i].patterns[j]!r}"
                 for (i, j), hit in used.items() if not hit]
    if unmatched:
        raise ConfigError("tensor_parallel.partition_config: these patterns match no module or weight of the model "
                          f"(names look like {view.example_name()!r}): " + "; ".join(unmatched))
    return user


def _pattern_hits(spec, name: str, model_type: str | None) -> list[int]:
    """Which of ``spec``'s patterns match ``name`` (or its weight), for a model of ``model_type``."""
    if spec.model_types is not None and (model_type or "").lower() not in spec.model_types:
        return []
    return [j for j, p in enumerate(spec.compiled) if p.match(name) or p.match(f"{name}.weight")]


# ---------------------------------------------------------------------------------------- what another layer placed
def drop_placed(view: ModelView, rules: dict[str, Rule], notes: list[str]) -> dict[str, str]:
    """Parameters another layer already laid out (a :class:`~polyaccel.parallel.ParamLayout` other than the
    default, e.g. AutoEP's experts over ``expert``) stay as that layer placed them: every rule whose module or
    bare parameter holds only such parameters is dropped, whatever its source (the model's plan marks experts
    ``moe_tp_experts``/``packed_colwise``; they are the expert layer's). A rule of the user's that would split
    them is an error. Returns ``{parameter name: the mesh dimension it is placed over}``."""
    from polyaccel.parallel import DEFAULT, get_layout

    placed = {}
    for n, p in view.model.named_parameters():
        layout = get_layout(p)
        if layout != DEFAULT:
            placed[n] = layout.split.dim if layout.split is not None else layout.replicas
    if not placed:
        return placed
    dropped, errors = [], []
    for name in list(rules):
        if name in view.params:
            covered = [name]
        elif name in view.modules:
            covered = [f"{name}.{pn}" if name else pn for pn, _ in view.modules[name].named_parameters()]
        else:
            continue
        if not covered or not all(c in placed for c in covered):
            continue
        r = rules.pop(name)
        if r.source == "partition_config" and r.style != SKIP:
            errors.append(f"{r.rule} matches {name}, whose parameters another layer already placed over "
                          f"{placed[covered[0]]!r}; AutoTP leaves them as placed (mark it skip, or drop the rule)")
        dropped.append(name)
    if errors:
        raise ConfigError("tensor_parallel: " + "; ".join(errors))
    shown = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in placed})
    dims = sorted(set(placed.values()))
    notes.append(f"{len(placed)} parameters already placed by another layer over {', '.join(dims)} "
                 f"({', '.join(shown[:3])}{' ...' if len(shown) > 3 else ''}): left whole on every tensor rank"
                 + (f"; {len(dropped)} plan rule(s) naming them dropped" if dropped else ""))
    return placed

# ------------------------------------------------------------------------------------------------ refusals
def refuse_unrun_styles(rules: dict[str, Rule], user: dict[str, Rule], view: ModelView) -> None:
    """Styles AutoTP does not run are an error, unless the user's rules skip the module (or a parent)."""
    refused: dict[tuple[str, str, bool], list[str]] = {}
    for name, r in rules.items():
        if r.style.startswith("?"):
            if any(user.get(p) is not None and user[p].style == SKIP for p in _ancestors(name)):
                continue
            refused.setdefault((r.source, r.rule, view.is_bare(name)), []).append(name)
    if not refused:
        return
    errors = [_unrun_style_error(source, rule, bare, names) for (source, rule, bare), names in refused.items()]
    example = json.dumps({"patterns": [_layer_pattern(next(iter(refused.values()))[0])],
                          "partition_type": "skip"})
    moe = any(".experts" in n or n.endswith("experts") for names in refused.values() for n in names)
    hint = (" (a MoE model's experts are AutoEP's: with an expert_parallel section they are placed over the "
            "expert ranks first, and AutoTP leaves them whole)") if moe else ""
    raise ConfigError("tensor_parallel: " + "; ".join(errors) + f". AutoTP runs the plan styles "
                      f"{sorted(HF_STYLES)}; to leave a module whole, mark it skip in "
                      f"tensor_parallel.partition_config.layer_specs, e.g. {example}{hint}")


def _unrun_style_error(source: str, rule: str, bare: bool, names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    if source == "partition_config":
        return f"partition_type {rule!r} matches bare parameters ({shown}); rules apply to modules"
    if bare:
        return (f"the model's plan gives style {rule} to bare parameters ({shown}); AutoTP runs plan "
                "styles on nn.Linear, Conv1D and nn.Embedding modules only")
    return f"the model's plan gives style {rule} to {shown}; AutoTP does not run that style"


def rules_by_kind(rules: dict[str, Rule], view: ModelView, notes: list[str]) -> dict[str, Rule]:
    """Only the rules of modules whose kind takes the style (skips and unrun styles dropped); a rule on
    a module of the wrong kind is refused."""
    resolved: dict[str, Rule] = {}
    errors: list[str] = []
    for name, r in rules.items():
        if r.style.startswith("?") or name not in view.modules or r.style == SKIP:
            continue
        if r.style != GRAD_SUM:
            error = _kind_error(name, r, view)
            if error is not None:
                errors.append(error)
                continue
            mod = view.modules[name]
            if view.kinds.get(name) == "embedding" and type(mod) is not nn.Embedding:
                notes.append(f"{name} is a {type(mod).__name__} (not a plain nn.Embedding): left whole")
                continue
        resolved[name] = r
    if errors:
        raise ConfigError("tensor_parallel: " + "; ".join(errors))
    return resolved


def _kind_error(name: str, r: Rule, view: ModelView) -> str | None:
    kind = view.kinds.get(name)
    cls = type(view.modules[name]).__name__
    if kind is None:
        return (f"module {name!r} ({cls}) has rule {r.rule!r}, but AutoTP splits "
                "only nn.Linear, Conv1D and nn.Embedding modules")
    if kind == "embedding" and r.style not in (VOCAB_EMBED,):
        return (f"embedding {name!r} has rule {r.rule!r}; an embedding is split on the vocabulary "
                "(partition_type 'vocab' / style 'embedding_rowwise') or left whole")
    if kind != "embedding" and r.style == VOCAB_EMBED:
        return f"module {name!r} ({cls}) has rule {r.rule!r}, which is for embeddings"
    if r.style == VOCAB_HEAD and name != view.out_emb:
        return (f"module {name!r} has rule 'vocab' but is not the model's output embedding (lm_head "
                f"is {view.out_emb!r})")
    return None


def tie_embeddings(resolved: dict[str, Rule], rules: dict[str, Rule], view: ModelView, notes: list[str]) -> bool:
    """Tied input/output embeddings share one vocab-parallel weight (or both stay whole); an lm_head given
    a column rule becomes the vocab head. Returns whether the embeddings are tied."""
    inp, out, modules = view.inp_emb, view.out_emb, view.modules
    tied = (inp is not None and out is not None and inp in modules and out in modules
            and modules[inp].weight is modules[out].weight)
    if tied and (resolved.get(inp) is None) != (resolved.get(out) is None):
        split, whole = (inp, out) if resolved.get(inp) is not None else (out, inp)
        if rules.get(whole) is not None and rules[whole].source == "partition_config" and \
                rules[whole].style == SKIP:
            raise ConfigError(f"tensor_parallel: {split!r} and {whole!r} share one weight (tied embeddings); "
                              f"{whole!r} is marked skip but {split!r} is split. Split both or skip both")
        if type(modules[inp]) is not nn.Embedding:
            resolved.pop(split, None)
            notes.append(f"{out} is tied to {inp}, which is left whole: both stay whole")
        else:
            style = VOCAB_EMBED if whole == inp else VOCAB_HEAD
            resolved[whole] = Rule(style, "tied", f"shares its weight with {split}")
    if out in resolved and resolved[out].style in (COLUMN, COLUMN_GATHER):
        r = resolved[out]
        resolved[out] = Rule(VOCAB_HEAD, r.source, r.rule)
    return tied


def check_strict_mode(cfg: TPConfig, rules: dict[str, Rule], view: ModelView) -> None:
    """In strict mode every linear needs a rule."""
    if not cfg.strict_mode:
        return
    loose = [n for n, k in view.kinds.items() if k in ("linear", "conv1d") and n not in rules]
    if loose:
        raise ConfigError("tensor_parallel.partition_config.strict_mode: no rule matches these linear layers: "
                          + ", ".join(loose[:10]) + (f" (and {len(loose) - 10} more)" if len(loose) > 10 else ""))


def _layer_pattern(name: str) -> str:
    """A regex for ``name`` in every layer: dots escaped, layer numbers generalised."""
    return re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name)) + "$"


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
