"""What AutoTP reads off a model without touching it: the kind and features of a layer, the Hugging Face
models inside it and their plans, the embeddings, the attention head counts, and the module names that
mark a layer's role (fused q/k/v, output projections, routers)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

Q_NAMES = {"q_proj", "query", "q", "wq", "q_b_proj"}
KV_NAMES = {"k_proj", "v_proj", "key", "value", "k", "v", "wk", "wv"}
QKV_CONCAT = {"qkv_proj", "c_attn", "Wqkv", "W_pack", "qkv", "wqkv"}  # [q | k | v]
QKV_INTERLEAVED = {"query_key_value"}  # per KV head: [q.. (group) | k | v]
GATE_UP = {"gate_up_proj", "w13"}  # [gate | up]
ROW_NAMES = {"o_proj", "out_proj", "down_proj", "c_proj", "dense_4h_to_h", "fc2", "fc_out", "w2", "wo"}
ATTN_PARENTS = ("attention", "self_attention", "self_attn", "attn")
SKIP_NAMES = {"router", "shared_expert_gate", "q_a_proj", "kv_a_proj_with_mqa"}
HEAD_NORMS = {"q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm"}


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


def plan_key_pattern(key: str) -> re.Pattern:
    """A Hugging Face plan key as a regex: ``*`` stands for one name part (a layer number)."""
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
                if ename is not None and not any(plan_key_pattern(k).fullmatch(ename) for k in own):
                    own[ename] = "embedding_rowwise"
        plan.update({prefix + k: v for k, v in own.items()})
    return plan


def _name_of(root: nn.Module, target: nn.Module) -> str | None:
    for name, mod in root.named_modules():
        if mod is target:
            return name
    return None


def _embedding(model, getter: str, cls):
    """``model.<getter>()`` (``get_input_embeddings``/``get_output_embeddings``) when it is a ``cls``."""
    get = getattr(model, getter, None)
    try:
        emb = get() if get is not None else None
    except (NotImplementedError, AttributeError):
        return None
    return emb if isinstance(emb, cls) else None


def _input_embeddings(model):
    return _embedding(model, "get_input_embeddings", nn.Embedding)


def _output_embeddings(model):
    return _embedding(model, "get_output_embeddings", nn.Linear)


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



def is_hf_attention(parent) -> bool:
    return type(parent).__module__.startswith("transformers.") and hasattr(parent, "config")


def join(parent: str, child: str) -> str:
    """The dotted name of ``child`` under ``parent`` (``parent`` may be the root, "")."""
    return f"{parent}.{child}" if parent else child


@dataclass
class ModelView:
    """The facts of one model that every step of plan inference reads, gathered once."""

    model: nn.Module
    hf_cfg: object  # the (outermost Hugging Face) model's config, or None
    model_type: str | None
    modules: dict[str, nn.Module]
    kinds: dict[str, str]  # module name -> linear, conv1d, embedding (modules AutoTP can split)
    params: dict[str, nn.Parameter]
    inp_emb: str | None  # the input embedding's module name
    out_emb: str | None  # the output embedding's (lm_head's)

    @classmethod
    def of(cls, model: nn.Module) -> ModelView:
        hf_cfg = model_config(model)
        modules = dict(model.named_modules())
        kinds = {n: k for n, m in modules.items() if (k := module_kind(m)) is not None}
        inp_emb, out_emb = embedding_names(model)
        return cls(model, hf_cfg, getattr(hf_cfg, "model_type", None), modules, kinds,
                   dict(model.named_parameters()), inp_emb, out_emb)

    @property
    def bare(self) -> list[str]:
        """Parameters not held by a module AutoTP splits (a fused 3-D expert weight, say)."""
        return [n for n in self.params if n.rpartition(".")[0] not in self.kinds]

    def is_bare(self, name: str) -> bool:
        return name in self.params and name not in self.modules

    def example_name(self) -> str:
        """A module name to show the user what names look like (the first linear's)."""
        for n, k in self.kinds.items():
            if k in ("linear", "conv1d"):
                return n
        return next(iter(self.modules), "")
