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

import json
import re
from dataclasses import dataclass, field

from polyaccel.errors import ConfigError
from torch import nn

from .config import LayerSpec, TPConfig, parse
from .shard import shard_sizes

# internal styles
COLUMN = "column"  # output features split, output stays split (feeds a row layer or attention)
COLUMN_GATHER = "column_gather"  # output features split, output gathered to full
ROW = "row"  # input features split, input arrives split, output all-reduced
ROW_SPLIT = "row_split_input"  # input features split, input arrives whole and is sliced
VOCAB_EMBED = "vocab_embedding"  # embedding rows (vocabulary) split, masked lookup + all-reduce
VOCAB_HEAD = "vocab_head"  # lm_head rows (vocabulary) split; logits gathered, or kept split for the loss
GRAD_SUM = "grad_sum"  # left whole, gradients partial over the tensor group (summed)
SKIP = "skip"

SPLIT_STYLES = (COLUMN, COLUMN_GATHER, ROW, ROW_SPLIT, VOCAB_EMBED, VOCAB_HEAD)

#: Hugging Face plan styles AutoTP runs, and what they become
HF_STYLES = {
    "colwise": COLUMN,
    "packed_colwise": COLUMN,  # [gate | up] packed: two sub-weights
    "colwise_gather_output": COLUMN_GATHER,
    "colwise_rep": COLUMN_GATHER,
    "rowwise": ROW,
    "rowwise_split_input": ROW_SPLIT,
    "rowwise_rep": ROW_SPLIT,
    "embedding_rowwise": VOCAB_EMBED,
    "replicated_with_grad_allreduce": GRAD_SUM,
}

Q_NAMES = {"q_proj", "query", "q", "wq", "q_b_proj"}
KV_NAMES = {"k_proj", "v_proj", "key", "value", "k", "v", "wk", "wv"}
QKV_CONCAT = {"qkv_proj", "c_attn", "Wqkv", "W_pack", "qkv", "wqkv"}  # [q | k | v]
QKV_INTERLEAVED = {"query_key_value"}  # per KV head: [q.. (group) | k | v]
GATE_UP = {"gate_up_proj", "w13"}  # [gate | up]
ROW_NAMES = {"o_proj", "out_proj", "down_proj", "c_proj", "dense_4h_to_h", "fc2", "fc_out", "w2", "wo"}
ATTN_PARENTS = ("attention", "self_attention", "self_attn", "attn")
SKIP_NAMES = {"router", "shared_expert_gate", "q_a_proj", "kv_a_proj_with_mqa"}
HEAD_NORMS = {"q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm"}


# ------------------------------------------------------------------------------------------------ plan objects
@dataclass(frozen=True)
class ModulePlan:
    """How one module is split. ``sections[j][r]``: rank r's size of sub-weight j along the split dim."""

    name: str
    style: str
    kind: str  # linear, conv1d, embedding, module
    sections: tuple[tuple[int, ...], ...] = ()
    source: str = ""  # partition_config, preset:<name>, hf_plan, heuristic, tied
    rule: str = ""  # the style or rule text it came from
    tied_with: str | None = None
    sub_names: tuple[str, ...] = ()  # names of the sub-weights (q, k, v / gate, up), for display

    def local(self, rank: int) -> int:
        return sum(s[rank] for s in self.sections)

    @property
    def full(self) -> int:
        return sum(sum(s) for s in self.sections)

    def weight_axis(self) -> int:
        """The dim of the module's stored ``weight`` that is split."""
        if self.style in (VOCAB_EMBED, VOCAB_HEAD):
            return 0
        column = self.style in (COLUMN, COLUMN_GATHER)
        if self.kind == "conv1d":  # weight stored [in, out]
            return 1 if column else 0
        return 0 if column else 1


@dataclass(frozen=True)
class AttentionPlan:
    """Heads each rank keeps in one attention module (whole KV heads, each with its query group)."""

    name: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    out_proj: str
    #: one all-reduce of the input gradient for all of q/k/v, at the module's input (Hugging Face
    #: attention, whose input feeds only the projections); else one per projection
    shared_input: bool = False

    @property
    def zero_head_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.kv_heads) if n == 0)


@dataclass
class TPPlan:
    tp: int
    source: str
    modules: dict[str, ModulePlan] = field(default_factory=dict)
    attention: dict[str, AttentionPlan] = field(default_factory=dict)
    grad_sum: tuple[str, ...] = ()  # parameter names: whole, gradient summed over the tensor group
    replicated: tuple[str, ...] = ()  # parameter names left whole (no split, complete gradients)
    #: parameters another layer placed before AutoTP (AutoEP's experts): left whole over tensor, layout kept
    placed: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    vocab_size: int | None = None

    def counts(self) -> dict[str, int]:
        c = {"column": 0, "row": 0, "vocab": 0, "replicated": len(self.replicated) + len(self.grad_sum)}
        for m in self.modules.values():
            if m.style in (COLUMN, COLUMN_GATHER):
                c["column"] += 1
            elif m.style in (ROW, ROW_SPLIT):
                c["row"] += 1
            elif m.style in (VOCAB_EMBED, VOCAB_HEAD):
                c["vocab"] += 1
        return c

    def rows(self) -> list[tuple[str, str, str, list[int]]]:
        """(module, style, source, per-rank shard sizes) for every split or grad-summed module."""
        out = []
        for m in self.modules.values():
            if m.style in SPLIT_STYLES:
                out.append((m.name, m.style, m.source, [m.local(r) for r in range(self.tp)]))
        return out

    def to_dict(self) -> dict:
        return {
            "tp": self.tp, "source": self.source, "counts": self.counts(), "vocab_size": self.vocab_size,
            "modules": {n: {"style": m.style, "kind": m.kind, "source": m.source, "rule": m.rule,
                            "sections": [list(s) for s in m.sections], "sub_names": list(m.sub_names),
                            "per_rank": [m.local(r) for r in range(self.tp)], "tied_with": m.tied_with}
                        for n, m in self.modules.items() if m.style != SKIP},
            "attention": {n: {"head_dim": a.head_dim, "num_heads": a.num_heads, "num_kv_heads": a.num_kv_heads,
                              "q_heads": list(a.q_heads), "kv_heads": list(a.kv_heads), "out_proj": a.out_proj}
                          for n, a in self.attention.items()},
            "grad_sum": list(self.grad_sum), "replicated": list(self.replicated), "placed": list(self.placed),
            "notes": list(self.notes),
        }

    def format(self, compact: bool = True) -> str:
        """A readable table; ``compact`` folds modules that differ only in their layer number."""
        lines = [f"tensor-parallel plan: tp={self.tp}, rules from {self.source}"]
        groups: dict[tuple, list[str]] = {}
        for m in self.modules.values():
            if m.style == SKIP:
                continue
            key_name = re.sub(r"\.\d+\.", ".*.", m.name) if compact else m.name
            sizes = " | ".join(_fmt_sizes(m, r) for r in range(self.tp)) if m.style != GRAD_SUM else "whole"
            key = (key_name, m.style, m.source, sizes, m.tied_with and re.sub(r"\.\d+\.", ".*.", m.tied_with))
            groups.setdefault(key, []).append(m.name)
        width = max([len(k[0]) for k in groups] + [6])
        lines.append(f"  {'module':<{width}}  {'style':<16} {'from':<18} per-rank shard (rank 0 | 1 | ...)")
        for (name, style, source, sizes, tied), members in groups.items():
            n = f" x{len(members)}" if len(members) > 1 else ""
            tie = f"  (shares its weight with {tied})" if tied else ""
            lines.append(f"  {name:<{width}}  {style:<16} {source:<18} {sizes}{n}{tie}")
        if self.attention:
            heads: dict[tuple, int] = {}
            for a in self.attention.values():
                k = (a.num_heads, a.num_kv_heads, a.head_dim, a.q_heads, a.kv_heads)
                heads[k] = heads.get(k, 0) + 1
            for (nh, nkv, hd, q, kv), n in heads.items():
                lines.append(f"  attention x{n}: {nh} heads / {nkv} KV heads of {hd} -> per rank "
                             f"q {list(q)}, kv {list(kv)}")
        c = self.counts()
        lines.append(f"  counts: {c['column']} column, {c['row']} row, {c['vocab']} vocab, "
                     f"{c['replicated']} replicated parameters ({len(self.grad_sum)} with grads summed over "
                     "the tensor group)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _fmt_sizes(m: ModulePlan, rank: int) -> str:
    if len(m.sections) == 1:
        return str(m.sections[0][rank])
    names = m.sub_names or tuple(str(i) for i in range(len(m.sections)))
    return "+".join(f"{n}{s[rank]}" for n, s in zip(names, m.sections, strict=True))


# ------------------------------------------------------------------------------------------------ model facts
def _conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # noqa: BLE001 - transformers is optional
        return None
    return Conv1D


def module_kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linear"
    conv = _conv1d_type()
    if conv is not None and isinstance(module, conv):
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return None


def features(module: nn.Module, kind: str) -> tuple[int, int]:
    """(in, out) features of a linear-like module."""
    w = module.weight
    if kind == "conv1d":
        return w.shape[0], w.shape[1]
    return w.shape[1], w.shape[0]


def _is_hf_model(module) -> bool:
    return hasattr(module, "config") and hasattr(module, "base_model_prefix") and hasattr(module, "post_init")


def hf_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face models in ``root`` (``root`` itself when it is one), with their prefixes."""
    if _is_hf_model(root):
        return [("", root)]
    found: list[tuple[str, nn.Module]] = []
    for name, mod in root.named_modules():
        if name and _is_hf_model(mod) and not any(name.startswith(p + ".") for p, _ in found):
            found.append((name + ".", mod))
    return found


def _glob(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"[^.]+"))


def hf_plan(root: nn.Module) -> dict[str, str]:
    """The model's Hugging Face plan, keys made relative to ``root`` (with ``*`` for layer numbers).

    Merges the class ``_tp_plan`` (where ``lm_head`` lives), ``config.base_model_tp_plan`` under the
    base model's prefix, the children's ``_tp_plan`` and the instance's (transformers 5 keeps the
    merged plan there). Like transformers 5, the input embeddings are split on the vocabulary
    unless the plan names them.
    """
    plan: dict[str, str] = {}
    for prefix, model in hf_models(root):
        own: dict[str, str] = dict(getattr(type(model), "_tp_plan", None) or {})
        base = getattr(model, "base_model", model)
        base_prefix = "" if base is model else getattr(model, "base_model_prefix", "")
        cfg_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
        own.update({(f"{base_prefix}.{k}" if base_prefix else k): v for k, v in cfg_plan.items()})
        for name, child in model.named_children():
            child_plan = child.__dict__.get("_tp_plan") or getattr(type(child), "_tp_plan", None)
            if child_plan:
                own.update({f"{name}.{k}": v for k, v in child_plan.items()})
        inst = model.__dict__.get("_tp_plan")
        if inst:
            own.update(inst)
        if own:
            emb = _input_embeddings(model)
            if emb is not None:
                ename = _name_of(model, emb)
                if ename is not None and not any(_glob(k).fullmatch(ename) for k in own):
                    own[ename] = "embedding_rowwise"
        plan.update({prefix + k: v for k, v in own.items()})
    return plan


def _name_of(root: nn.Module, target: nn.Module) -> str | None:
    for name, mod in root.named_modules():
        if mod is target:
            return name
    return None


def _input_embeddings(model):
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if get is not None else None
    except (NotImplementedError, AttributeError):
        return None
    return emb if isinstance(emb, nn.Embedding) else None


def _output_embeddings(model):
    get = getattr(model, "get_output_embeddings", None)
    try:
        out = get() if get is not None else None
    except (NotImplementedError, AttributeError):
        return None
    return out if isinstance(out, nn.Linear) else None


def embedding_names(root: nn.Module) -> tuple[str | None, str | None]:
    """(input embedding, output embedding/lm_head) module names, where they can be found."""
    inp = out = None
    for prefix, model in hf_models(root):
        e, o = _input_embeddings(model), _output_embeddings(model)
        if inp is None and e is not None:
            inp = prefix + (_name_of(model, e) or "")
        if out is None and o is not None:
            out = prefix + (_name_of(model, o) or "")
    if out is None:
        for name, mod in root.named_modules():
            if name.split(".")[-1] in ("lm_head", "embed_out") and isinstance(mod, nn.Linear):
                out = name
                break
    return inp, out


def model_config(root: nn.Module):
    models = hf_models(root)
    return models[0][1].config if models else getattr(root, "config", None)


def _int_attr(obj, *names):
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def head_counts(parent: nn.Module, cfg) -> tuple[int, int, int] | None:
    """(heads, KV heads, head dim) of an attention module, from its attributes or the model config."""
    pcfg = getattr(parent, "config", None) or cfg
    n_heads = _int_attr(parent, "num_heads", "num_attention_heads", "n_heads", "n_head")
    if n_heads is None and pcfg is not None:
        n_heads = _int_attr(pcfg, "num_attention_heads", "n_head", "num_heads")
    if n_heads is None:
        return None
    n_kv = _int_attr(parent, "num_key_value_heads", "num_kv_heads", "n_kv_heads")
    if n_kv is None and pcfg is not None:
        n_kv = _int_attr(pcfg, "num_key_value_heads", "num_kv_heads", "multi_query_group_num")
    n_kv = n_kv or n_heads
    head_dim = _int_attr(parent, "head_dim", "head_size")
    if head_dim is None and pcfg is not None:
        head_dim = _int_attr(pcfg, "head_dim")
        if head_dim is None:
            hidden = _int_attr(pcfg, "hidden_size", "n_embd", "d_model")
            head_dim = hidden // n_heads if hidden and hidden % n_heads == 0 else None
    if head_dim is None:
        return None
    return n_heads, n_kv, head_dim


# ------------------------------------------------------------------------------------------------ presets
def _preset(name: str) -> tuple[LayerSpec, ...]:
    def spec(pattern, ptype, sub=None):
        return LayerSpec((pattern,), ptype, sub, False, None, f"preset_model {name!r}", (re.compile(pattern),))

    llama = [
        spec(r".*self_attn\.[qkv]_proj$", "column"),
        spec(r".*self_attn\.o_proj$", "row"),
        spec(r".*mlp\.(gate|up)_proj$", "column"),
        spec(r".*mlp\.down_proj$", "row"),
        spec(r"(.*\.)?embed_tokens$", "vocab"),
        spec(r"(.*\.)?lm_head$", "vocab"),
    ]
    if name in ("llama", "mistral", "qwen2"):
        return tuple(llama)
    if name == "qwen3":
        return (*llama, spec(r".*self_attn\.[qk]_norm$", "replicated_with_grad_allreduce"))
    if name == "phi3":
        return (
            spec(r".*self_attn\.qkv_proj$", "column"),  # fused [q | k | v], split on whole KV heads
            spec(r".*self_attn\.o_proj$", "row"),
            spec(r".*mlp\.gate_up_proj$", "column", 2),
            spec(r".*mlp\.down_proj$", "row"),
            spec(r"(.*\.)?embed_tokens$", "vocab"),
            spec(r"(.*\.)?lm_head$", "vocab"),
        )
    if name == "gpt2":
        return (
            spec(r".*attn\.c_attn$", "column"),
            spec(r".*attn\.c_proj$", "row"),
            spec(r".*mlp\.c_fc$", "column"),
            spec(r".*mlp\.c_proj$", "row"),
            spec(r"(.*\.)?wte$", "vocab"),
            spec(r"(.*\.)?lm_head$", "vocab"),
        )
    raise ConfigError(f"unknown preset_model {name!r}")  # parse() already rejects it


# ------------------------------------------------------------------------------------------------ rule resolution
@dataclass
class _Rule:
    style: str  # an internal style, or "?<hf style>" for a style AutoTP does not run
    source: str
    rule: str
    sub_params: int | tuple[int, ...] | None = None


def _spec_rule(spec: LayerSpec, source: str, kind: str | None, is_head: bool) -> _Rule:
    t = spec.partition_type
    if t == "skip":
        style = SKIP
    elif t == "replicated_with_grad_allreduce":
        style = GRAD_SUM
    elif t == "vocab":
        style = VOCAB_EMBED if kind == "embedding" else VOCAB_HEAD
    elif t == "column":
        style = COLUMN_GATHER if spec.gather_output else COLUMN
    else:
        style = ROW
    rule = f"{t} ({spec.where}: {spec.patterns[0]!r})" if source == "partition_config" else t
    return _Rule(style, source, rule, spec.sub_params)


def _heuristic_rules(root: nn.Module, kinds: dict[str, str], out_emb: str | None,
                     inp_emb: str | None) -> dict[str, _Rule]:
    """DeepSpeed's structure rule: per parent, row if named like an output projection or the last
    linear before a norm, fused names split per sub-weight, routers/gates skipped, the rest column.
    A parent's linears are split only when it has both a column and a row (else its output would
    stay split); the vocabulary layers are split on the vocabulary."""
    rules: dict[str, _Rule] = {}
    for pname, parent in root.named_modules():
        children = list(parent.named_children())
        linear = [(n, c) for n, c in children if kinds.get(_join(pname, n)) in ("linear", "conv1d")
                  and _join(pname, n) != out_emb]
        if not linear:
            continue
        pshort = pname.split(".")[-1]
        proposed: dict[str, _Rule] = {}
        for i, (n, _c) in enumerate(children):
            full = _join(pname, n)
            if kinds.get(full) not in ("linear", "conv1d") or full == out_emb:
                continue
            nxt = children[i + 1][1] if i + 1 < len(children) else None
            before_norm = nxt is not None and "norm" in type(nxt).__name__.lower()
            if n in SKIP_NAMES or (n == "gate" and pshort in ("mlp", "block_sparse_moe", "moe", "feed_forward")):
                proposed[full] = _Rule(SKIP, "heuristic", "router/gate: left whole")
            elif n in QKV_CONCAT or n in QKV_INTERLEAVED:
                proposed[full] = _Rule(COLUMN, "heuristic", "fused qkv: column per sub-weight")
            elif n in GATE_UP:
                proposed[full] = _Rule(COLUMN, "heuristic", "packed gate/up: column per half", 2)
            elif n in ROW_NAMES or (n == "dense" and pshort in ATTN_PARENTS) or before_norm:
                proposed[full] = _Rule(ROW, "heuristic", "output projection: row")
            else:
                proposed[full] = _Rule(COLUMN, "heuristic", "column")
        styles = {r.style for r in proposed.values()}
        if COLUMN in styles and ROW in styles:
            rules.update(proposed)
        else:
            rules.update({k: _Rule(SKIP, "heuristic", "no column/row pair in its parent: left whole")
                          for k, r in proposed.items()})
    if out_emb is not None:
        rules[out_emb] = _Rule(VOCAB_HEAD, "heuristic", "lm_head: vocab")
    if inp_emb is not None:
        rules[inp_emb] = _Rule(VOCAB_EMBED, "heuristic", "input embedding: vocab")
    return rules


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


# ------------------------------------------------------------------------------------------------ inference
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
    hf_cfg = model_config(model)
    model_type = getattr(hf_cfg, "model_type", None)

    modules = dict(model.named_modules())
    kinds = {n: k for n, m in modules.items() if (k := module_kind(m)) is not None}
    params = dict(model.named_parameters())
    inp_emb, out_emb = embedding_names(model)
    errors: list[str] = []
    notes: list[str] = []

    # ---- the base plan: preset, else the HF plan, else heuristics
    base: dict[str, _Rule] = {}
    hf: dict[str, str] = {}
    if cfg.use_default_specs:
        if cfg.preset_model:
            source = f"preset_model {cfg.preset_model!r}"
            for name in modules:
                for spec in _preset(cfg.preset_model):
                    if spec.matches(name, model_type):
                        base[name] = _spec_rule(spec, f"preset:{cfg.preset_model}", kinds.get(name),
                                                name == out_emb)
                        break
        else:
            hf = hf_plan(model)
            if hf:
                source = "the model's Hugging Face plan"
            else:
                source = "name/structure heuristics (the model has no Hugging Face plan)"
                base = _heuristic_rules(model, kinds, out_emb, inp_emb)
    else:
        source = "partition_config only (use_default_specs: false)"
    if cfg.has_user_specs:
        source = "partition_config, then " + source if cfg.use_default_specs else source

    # ---- the user's rules, per module and per parameter (a fused expert weight is a parameter)
    user: dict[str, _Rule] = {}
    used = {(i, j): False for i, s in enumerate(cfg.layer_specs) for j in range(len(s.compiled))}
    # bare parameters: those not held by a module AutoTP splits (a fused 3-D expert weight, say)
    bare = [n for n in params if n.rpartition(".")[0] not in kinds]
    for name in list(modules) + bare:
        for i, spec in enumerate(cfg.layer_specs):
            hits = [j for j, p in enumerate(spec.compiled)
                    if (spec.model_types is None or (model_type or "").lower() in spec.model_types)
                    and (p.match(name) or p.match(f"{name}.weight"))]
            if hits:
                for j in hits:
                    used[(i, j)] = True
                if name not in user and name in modules:
                    user[name] = _spec_rule(spec, "partition_config", kinds.get(name), name == out_emb)
                elif name not in user and name in params:
                    user[name] = _Rule(SKIP if spec.partition_type == "skip" else "?" + spec.partition_type,
                                       "partition_config", spec.partition_type)
                break
    unmatched = [f"{cfg.layer_specs[i].where}.patterns[{j}] {cfg.layer_specs[i].patterns[j]!r}"
                 for (i, j), hit in used.items() if not hit]
    if unmatched:
        raise ConfigError("tensor_parallel.partition_config: these patterns match no module or weight of the model "
                          f"(names look like {_example_name(modules, kinds)!r}): " + "; ".join(unmatched))

    # ---- the HF plan, against module and parameter names
    if hf:
        compiled = [(k, _glob(k), v) for k, v in hf.items()]
        for name in list(modules) + bare:
            if not name:
                continue
            for key, pat, style in compiled:
                if pat.fullmatch(name):
                    # a style on a bare parameter (a fused 3-D expert weight) is not one AutoTP runs
                    internal = HF_STYLES.get(style) if name in modules else None
                    if internal is None:
                        base[name] = _Rule("?" + style, "hf_plan", f"{style} ({key})")
                    else:
                        sub = 2 if style == "packed_colwise" else None
                        if internal in (COLUMN, COLUMN_GATHER) and name == out_emb:
                            internal = VOCAB_HEAD
                        base[name] = _Rule(internal, "hf_plan", style, sub)
                    break

    rules = dict(base)
    rules.update(user)
    placed = _drop_placed(model, modules, params, rules, notes)

    # ---- styles AutoTP does not run: an error unless the user's rules skip the module (or a parent)
    refused: dict[tuple[str, str, bool], list[str]] = {}
    for name, r in rules.items():
        if r.style.startswith("?"):
            if any(user.get(p) is not None and user[p].style == SKIP for p in _ancestors(name)):
                continue
            bare = name in params and name not in modules
            refused.setdefault((r.source, r.rule, bare), []).append(name)
    for (source, rule, bare), names in refused.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        if source == "partition_config":
            errors.append(f"partition_type {rule!r} matches bare parameters ({shown}); rules apply to modules")
        elif bare:
            errors.append(f"the model's plan gives style {rule} to bare parameters ({shown}); AutoTP runs plan "
                          "styles on nn.Linear, Conv1D and nn.Embedding modules only")
        else:
            errors.append(f"the model's plan gives style {rule} to {shown}; AutoTP does not run that style")
    if errors:
        example = json.dumps({"patterns": [_layer_pattern(next(iter(refused.values()))[0])],
                              "partition_type": "skip"})
        moe = any(".experts" in n or n.endswith("experts") for names in refused.values() for n in names)
        hint = (" (a MoE model's experts are AutoEP's: with an expert_parallel section they are placed over the "
                "expert ranks first, and AutoTP leaves them whole)") if moe else ""
        raise ConfigError("tensor_parallel: " + "; ".join(errors) + f". AutoTP runs the plan styles "
                          f"{sorted(HF_STYLES)}; to leave a module whole, mark it skip in "
                          f"tensor_parallel.partition_config.layer_specs, e.g. {example}{hint}")

    # ---- keep only rules for modules of a kind that takes the style
    plan = TPPlan(tp=tp, source=source, notes=notes)
    resolved: dict[str, _Rule] = {}
    for name, r in rules.items():
        if r.style.startswith("?") or name not in modules or r.style == SKIP:
            continue
        kind = kinds.get(name)
        if r.style == GRAD_SUM:
            resolved[name] = r
            continue
        if kind is None:
            errors.append(f"module {name!r} ({type(modules[name]).__name__}) has rule {r.rule!r}, but AutoTP splits "
                          "only nn.Linear, Conv1D and nn.Embedding modules")
            continue
        if kind == "embedding" and r.style not in (VOCAB_EMBED,):
            errors.append(f"embedding {name!r} has rule {r.rule!r}; an embedding is split on the vocabulary "
                          "(partition_type 'vocab' / style 'embedding_rowwise') or left whole")
            continue
        if kind != "embedding" and r.style == VOCAB_EMBED:
            errors.append(f"module {name!r} ({type(modules[name]).__name__}) has rule {r.rule!r}, which is for "
                          "embeddings")
            continue
        if r.style == VOCAB_HEAD and name != out_emb:
            errors.append(f"module {name!r} has rule 'vocab' but is not the model's output embedding (lm_head "
                          f"is {out_emb!r})")
            continue
        if kind == "embedding" and type(modules[name]) is not nn.Embedding:
            notes.append(f"{name} is a {type(modules[name]).__name__} (not a plain nn.Embedding): left whole")
            continue
        resolved[name] = r
    if errors:
        raise ConfigError("tensor_parallel: " + "; ".join(errors))

    # ---- tied input/output embeddings share one vocab-parallel weight (or both stay whole)
    tied = (inp_emb is not None and out_emb is not None and inp_emb in modules and out_emb in modules
            and modules[inp_emb].weight is modules[out_emb].weight)
    if tied:
        a, b = resolved.get(inp_emb), resolved.get(out_emb)
        if (a is None) != (b is None):
            split, whole = (inp_emb, out_emb) if a is not None else (out_emb, inp_emb)
            if rules.get(whole) is not None and rules[whole].source == "partition_config" and \
                    rules[whole].style == SKIP:
                raise ConfigError(f"tensor_parallel: {split!r} and {whole!r} share one weight (tied embeddings); "
                                  f"{whole!r} is marked skip but {split!r} is split. Split both or skip both")
            if type(modules[inp_emb]) is not nn.Embedding:
                resolved.pop(split, None)
                notes.append(f"{out_emb} is tied to {inp_emb}, which is left whole: both stay whole")
            else:
                style = VOCAB_EMBED if whole == inp_emb else VOCAB_HEAD
                resolved[whole] = _Rule(style, "tied", f"shares its weight with {split}")
    if out_emb in resolved and resolved[out_emb].style in (COLUMN, COLUMN_GATHER):
        r = resolved[out_emb]
        resolved[out_emb] = _Rule(VOCAB_HEAD, r.source, r.rule)

    # ---- strict mode: every linear needs a rule
    if cfg.strict_mode:
        loose = [n for n, k in kinds.items() if k in ("linear", "conv1d") and n not in rules]
        if loose:
            raise ConfigError("tensor_parallel.partition_config.strict_mode: no rule matches these linear layers: "
                              + ", ".join(loose[:10]) + (f" (and {len(loose) - 10} more)" if len(loose) > 10 else ""))

    # ---- sizes: attention on whole heads, the rest by the uneven rule; pairs must agree
    _size_modules(model, modules, kinds, resolved, plan, hf_cfg, out_emb, inp_emb, tied, rules)
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
    for n, p in model.named_parameters():
        if id(p) in split_params or n in gsum or id(p) in seen or n in placed:
            continue
        seen.add(id(p))
        replicated.append(n)
    plan.grad_sum = tuple(gsum)
    plan.replicated = tuple(replicated)
    plan.placed = tuple(placed)
    if hf_cfg is not None:
        plan.vocab_size = getattr(hf_cfg, "vocab_size", None)
    _dropout_note(model, plan)
    return plan


def _drop_placed(model, modules, params, rules, notes) -> dict[str, str]:
    """Parameters another layer already laid out (a :class:`~polyaccel.parallel.ParamLayout` other than the
    default, e.g. AutoEP's experts over ``expert``) stay as that layer placed them: every rule whose module or
    bare parameter holds only such parameters is dropped, whatever its source (the model's plan marks experts
    ``moe_tp_experts``/``packed_colwise``; they are the expert layer's). A rule of the user's that would split
    them is an error. Returns ``{parameter name: the mesh dimension it is placed over}``."""
    from polyaccel.parallel import DEFAULT, get_layout

    placed = {}
    for n, p in model.named_parameters():
        layout = get_layout(p)
        if layout != DEFAULT:
            placed[n] = layout.split.dim if layout.split is not None else layout.replicas
    if not placed:
        return placed
    dropped, errors = [], []
    for name in list(rules):
        if name in params:
            covered = [name]
        elif name in modules:
            covered = [f"{name}.{pn}" if name else pn for pn, _ in modules[name].named_parameters()]
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


def _layer_pattern(name: str) -> str:
    """A regex for ``name`` in every layer: dots escaped, layer numbers generalised."""
    return re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name)) + "$"


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _example_name(modules, kinds) -> str:
    for n, k in kinds.items():
        if k in ("linear", "conv1d"):
            return n
    return next(iter(modules), "")


def _dropout_note(model, plan: TPPlan) -> None:
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Dropout) and mod.p > 0 and plan.tp > 1:
            plan.notes.append(f"dropout {name} (p={mod.p}) is on: tensor-parallel ranks must draw the same dropout "
                              "masks on replicated activations, which needs the same seed on every rank of a group "
                              "(exact equality with one process is only claimed with dropout off)")
            return


def _size_modules(model, modules, kinds, resolved, plan: TPPlan, hf_cfg, out_emb, inp_emb, tied, rules) -> None:
    tp = plan.tp
    errors: list[str] = []
    by_parent: dict[str, list[str]] = {}
    for name in resolved:
        parent = name.rpartition(".")[0]
        by_parent.setdefault(parent, []).append(name)

    def add(name, style, sections, rule, sub_names=(), tied_with=None):
        plan.modules[name] = ModulePlan(name, style, kinds.get(name, "module"), tuple(tuple(s) for s in sections),
                                        rule.source, rule.rule, tied_with, tuple(sub_names))

    order = {n: i for i, n in enumerate(modules)}
    for pname in sorted(by_parent, key=lambda p: order.get(p, -1)):
        names = sorted(by_parent[pname], key=lambda n: order[n])
        parent = modules.get(pname)
        local_cols = [n for n in names if resolved[n].style == COLUMN]
        rows = [n for n in names if resolved[n].style == ROW]
        short = {n: n.rpartition(".")[2] for n in names}
        attention = any(short[n] in Q_NAMES | KV_NAMES | QKV_CONCAT | QKV_INTERLEAVED for n in local_cols)
        if local_cols and not rows:
            errors.append(f"{', '.join(local_cols)} in {pname or 'the model'} are column-parallel with a split output, "
                          "but no row-parallel layer in the same module takes it; make one row-parallel, or use "
                          "colwise_gather_output / gather_output")
            continue
        if rows and not local_cols:
            errors.append(f"{', '.join(rows)} in {pname or 'the model'} are row-parallel over a split input, but no "
                          "column-parallel layer in the same module splits it; use rowwise_split_input, or make "
                          "the producer column-parallel")
            continue
        if len(rows) > 1:
            errors.append(f"{pname} has several row-parallel layers ({', '.join(rows)}); AutoTP pairs one row "
                          "layer with the column layers of a module")
            continue
        row = rows[0] if rows else None

        if attention:
            heads = head_counts(parent, hf_cfg)
            if heads is None:
                errors.append(f"attention {pname!r}: its head counts are unknown (no num_attention_heads / head_dim "
                              "on the module or the model config), so q/k/v cannot be split on whole heads")
                continue
            n_heads, n_kv, hd = heads
            if n_heads % n_kv:
                errors.append(f"attention {pname!r}: {n_heads} heads are not a multiple of {n_kv} KV heads")
                continue
            group = n_heads // n_kv
            kv = shard_sizes(n_kv, tp)
            q = tuple(k * group for k in kv)
            if getattr(parent, "is_cross_attention", False):
                errors.append(f"attention {pname!r} is cross-attention; AutoTP splits self-attention only (mark its "
                              "projections skip)")
                continue
            if 0 in kv and not (_is_hf_attention(parent) and row is not None):
                errors.append(f"autotp_size {tp} is more than the {n_kv} KV heads of {pname!r} "
                              f"({type(parent).__name__}): ranks would hold no heads, and AutoTP runs such ranks "
                              "only for Hugging Face attention modules")
                continue
            ok = True
            for n in local_cols:
                fin, fout = features(modules[n], kinds[n])
                r = resolved[n]
                s = short[n]
                if s in QKV_INTERLEAVED and r.sub_params is None:
                    want, secs, subn = n_kv * (group + 2) * hd, [[k * (group + 2) * hd for k in kv]], ()
                elif s in QKV_CONCAT or (r.sub_params is not None):
                    sizes = (n_heads * hd, n_kv * hd, n_kv * hd)
                    if r.sub_params is not None and r.sub_params not in (3, sizes):
                        errors.append(f"{n}: its rule's shape {r.sub_params!r} does not match the attention's "
                                      f"[q | k | v] sizes {list(sizes)} ({n_heads} heads, {n_kv} KV heads of {hd})")
                        ok = False
                        continue
                    want = sum(sizes)
                    secs = [[x * hd for x in q], [x * hd for x in kv], [x * hd for x in kv]]
                    subn = ("q", "k", "v")
                elif s in Q_NAMES:
                    want, secs, subn = n_heads * hd, [[x * hd for x in q]], ()
                else:
                    want, secs, subn = n_kv * hd, [[x * hd for x in kv]], ()
                if fout != want:
                    errors.append(f"{n}: {fout} output features, but {n_heads} heads / {n_kv} KV heads of {hd} "
                                  f"need {want}")
                    ok = False
                    continue
                add(n, COLUMN, secs, r, subn)
            fin, _ = features(modules[row], kinds[row])
            if fin != n_heads * hd:
                errors.append(f"{row}: {fin} input features, but the attention's {n_heads} heads of {hd} give "
                              f"{n_heads * hd}")
                ok = False
            if not ok:
                continue
            add(row, ROW, [[x * hd for x in q]], resolved[row])
            plan.attention[pname] = AttentionPlan(pname, hd, n_heads, n_kv, q, kv, row, _is_hf_attention(parent))
            _check_siblings(pname, parent, modules, resolved, rules, plan, errors, head_dim=hd, attention=True)
            others = [n for n in names if n not in local_cols and n != row]
        else:
            others = list(names)
            if row is not None:
                fin, _ = features(modules[row], kinds[row])
                rsec = shard_sizes(fin, tp)
                add(row, ROW, [rsec], resolved[row])
                for n in local_cols:
                    _, fout = features(modules[n], kinds[n])
                    secs, subn = _sub_sections(n, fout, resolved[n].sub_params, tp, errors)
                    if secs is None:
                        continue
                    for sec in secs:
                        if tuple(sec) != rsec:
                            errors.append(f"{n} gives the ranks {list(sec)} features but {row} expects "
                                          f"{list(rsec)}; their split sizes must agree")
                            break
                    else:
                        add(n, COLUMN, secs, resolved[n], subn)
                _check_siblings(pname, parent, modules, resolved, rules, plan, errors, head_dim=None,
                                attention=False)
                others = [n for n in names if n not in local_cols and n != row]
        for n in others:
            r = resolved[n]
            if r.style == GRAD_SUM:
                if n not in plan.modules:
                    add(n, GRAD_SUM, [], r)
            elif r.style == COLUMN_GATHER:
                _, fout = features(modules[n], kinds[n])
                sub = r.sub_params
                if sub is None and short[n] in QKV_CONCAT:
                    heads = head_counts(parent, hf_cfg)
                    if heads is not None and (heads[0] + 2 * heads[1]) * heads[2] == fout:
                        sub = (heads[0] * heads[2], heads[1] * heads[2], heads[1] * heads[2])
                if sub is None and short[n] in GATE_UP:
                    sub = 2
                secs, subn = _sub_sections(n, fout, sub, tp, errors)
                if secs is not None:
                    add(n, COLUMN_GATHER, secs, r, subn)
            elif r.style == ROW_SPLIT:
                fin, _ = features(modules[n], kinds[n])
                add(n, ROW_SPLIT, [shard_sizes(fin, tp)], r)
            elif r.style in (VOCAB_EMBED, VOCAB_HEAD):
                vocab = modules[n].weight.shape[0]
                tied_with = (out_emb if n == inp_emb else inp_emb) if tied else None
                add(n, r.style, [shard_sizes(vocab, tp)], r, tied_with=tied_with)
    if errors:
        raise ConfigError("tensor_parallel: " + "; ".join(errors))


def _sub_sections(name, fout, sub, tp, errors):
    if sub is None:
        return [shard_sizes(fout, tp)], ()
    sizes = (fout // sub,) * sub if isinstance(sub, int) else tuple(sub)
    if isinstance(sub, int) and fout % sub:
        errors.append(f"{name}: {fout} output features do not split into {sub} equal sub-weights")
        return None, ()
    if sum(sizes) != fout:
        errors.append(f"{name}: sub-weight sizes {list(sizes)} add up to {sum(sizes)}, not its {fout} output features")
        return None, ()
    names = ("gate", "up") if len(sizes) == 2 else ("q", "k", "v") if len(sizes) == 3 else ()
    return [shard_sizes(s, tp) for s in sizes], names


def _is_hf_attention(parent) -> bool:
    return type(parent).__module__.startswith("transformers.") and hasattr(parent, "config")


def _check_siblings(pname, parent, modules, resolved, rules, plan, errors, head_dim, attention) -> None:
    """Parameters next to split layers see split activations: per-head norms get grad_sum, others are refused."""
    for pn, _p in parent.named_parameters(recurse=False):
        errors.append(f"{pname}.{pn} is a parameter of {pname}, whose layers are split, and AutoTP cannot tell how "
                      f"to split it; mark {pname}'s layers skip")
    for cn, child in parent.named_children():
        full = _join(pname, cn)
        if full in resolved and resolved[full].style != GRAD_SUM:
            continue
        own = list(child.named_parameters())
        if not own:
            continue
        r = rules.get(full)
        if r is not None and r.style == SKIP and r.source == "partition_config":
            continue  # the user says it sees whole activations
        if full in resolved:  # grad_sum by rule
            plan.modules[full] = ModulePlan(full, GRAD_SUM, "module", (), resolved[full].source, resolved[full].rule)
            continue
        if attention and cn in HEAD_NORMS and all(p.numel() == head_dim for _, p in own):
            plan.modules[full] = ModulePlan(full, GRAD_SUM, "module", (), "heuristic",
                                            "per-head norm: gradient summed over the tensor group")
            continue
        errors.append(f"{full} ({type(child).__name__}) sits between the split layers of {pname} and has "
                      "parameters AutoTP cannot split; mark it replicated_with_grad_allreduce if it acts on each "
                      "rank's share alone (like a per-head norm), or skip if it sees whole activations")


__all__ = [
    "COLUMN", "COLUMN_GATHER", "GRAD_SUM", "HF_STYLES", "ROW", "ROW_SPLIT", "SKIP", "VOCAB_EMBED", "VOCAB_HEAD",
    "AttentionPlan", "ModulePlan", "TPPlan", "embedding_names", "head_counts", "hf_plan", "infer_plan",
    "module_kind",
]
