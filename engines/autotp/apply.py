"""Shard a model over the tensor group by its plan.

Everything that can be refused is refused by :func:`~.plan.infer_plan` and the checks here
before the first module is replaced; then, per split module, this rank's piece of each weight is
copied into a new parameter carrying a :class:`~polyaccel.parallel.ParamLayout` with its
:class:`~polyaccel.parallel.Split`, and the module is swapped for its tensor-parallel version.
Attention modules get this rank's head counts, so the model's own attention code runs unchanged;
a rank left with no heads skips the attention and feeds zeros to the output projection's
all-reduce. The lm_head keeps the logits split when the model is called with labels, and the
model's loss function becomes the vocab-parallel cross-entropy.

At ``tp == 1`` nothing is replaced and nothing communicates; the plan is still recorded.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

from polyaccel.errors import ConfigError
from polyaccel.parallel import DEFAULT, ParamLayout, Split, get_layout, set_layout, set_plan
from torch import nn

from .config import TPConfig, parse
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead, copy_to_tp
from .loss import causal_lm_loss
from .model_facts import features
from .plan import infer_plan
from .plan_objects import (
    COLUMN,
    COLUMN_GATHER,
    GRAD_SUM,
    ROW,
    ROW_SPLIT,
    VOCAB_EMBED,
    VOCAB_HEAD,
    AttentionPlan,
    ModulePlan,
    TPPlan,
)

PLAN_ATTR = "polyaccel_tp_plan"
STATE_ATTR = "polyaccel_tp"

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
_WIDTH_ATTRS = ("embed_dim", "hidden_size", "split_size", "all_head_size", "inner_dim")


@dataclass
class TPState:
    """What AutoTP leaves on a model it sharded (``model.polyaccel_tp``)."""

    plan: TPPlan
    rank: int
    group: object
    mesh: object = None


def get_plan(model: nn.Module) -> TPPlan | None:
    """The plan AutoTP applied to ``model`` (also found through an engine's ``module``)."""
    model = getattr(model, "module", model)
    return getattr(model, PLAN_ATTR, None)


class LocalHeadsConfig:
    """A model config seen by one attention module: this rank's head counts, the rest shared (live)."""

    def __init__(self, base, overrides: dict):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_overrides", dict(overrides))

    def __getattr__(self, name):
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_base"), name)

    def __setattr__(self, name, value):
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            overrides[name] = value
        else:
            setattr(object.__getattribute__(self, "_base"), name, value)

    def __repr__(self) -> str:
        return f"LocalHeadsConfig({object.__getattribute__(self, '_overrides')}, base={type(self._base).__name__})"


def _no_heads_forward(module, out_proj: str, *args, **kwargs):
    """The attention of a rank that holds no heads: the output projection's all-reduce, fed an empty
    slice of the input (so the input gradient's all-reduce runs here too, with zeros)."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if hidden is None:
        raise TypeError(f"{type(module).__name__} called without hidden_states")
    out = getattr(module, out_proj)(hidden[..., :0])
    return out, None


def _owner_uses_loss_function(owner: nn.Module) -> bool:
    try:
        return "self.loss_function(" in inspect.getsource(type(owner).forward)
    except (OSError, TypeError):
        return False


def _mesh_facts(mesh, group, rank, tp):
    if mesh is not None:
        return mesh.group("tensor"), mesh.rank("tensor"), mesh.size("tensor")
    if tp is None or rank is None:
        raise ConfigError("apply_tensor_parallel needs a mesh, or group, rank and tp")
    return group, rank, tp


def apply_tensor_parallel(model: nn.Module, section: dict | TPConfig, mesh=None, *, group=None,
                          rank: int | None = None, tp: int | None = None) -> nn.Module:
    """Shard ``model`` in place over the mesh's ``tensor`` dimension; returns it."""
    cfg = parse(section)
    group, rank, tp = _mesh_facts(mesh, group, rank, tp)
    if cfg.autotp_size != tp:
        raise ConfigError(f"tensor_parallel.autotp_size is {cfg.autotp_size} but the mesh's tensor dimension has "
                          f"{tp} ranks")
    plan = infer_plan(model, tp, cfg)
    modules = dict(model.named_modules())
    _refuse_placed(model, plan, modules)
    if tp > 1:
        replacements = _build_replacements(plan, modules, rank, group)  # the model is untouched until all are built
        _swap_in(model, modules, replacements)
        for name in plan.grad_sum:
            set_layout(model.get_parameter(name), ParamLayout(grad_sum="tensor"))
        for att in plan.attention.values():
            _localise_heads(modules[att.name], att, rank, group)
        _install_vocab_loss(model, plan)
    setattr(model, PLAN_ATTR, plan)
    set_plan(model, "tensor", plan)
    setattr(model, STATE_ATTR, TPState(plan, rank, group, mesh))
    return model


def _refuse_placed(model: nn.Module, plan: TPPlan, modules: dict[str, nn.Module]) -> None:
    """A parameter the plan splits or grad-sums must not be placed already by another layer (infer_plan leaves
    whole what another layer placed; a mix in one module is refused here)."""
    touched = list(plan.grad_sum) + [f"{n}.{pn}" for n, m in plan.modules.items() if m.style != GRAD_SUM
                                     for pn in ("weight", "bias") if getattr(modules[n], pn, None) is not None]
    for name in touched:
        layout = get_layout(model.get_parameter(name))
        if layout != DEFAULT:
            where = layout.split.dim if layout.split is not None else layout.replicas
            raise ConfigError(f"parameter {name} is already placed over {where!r} by another layer; AutoTP "
                              "cannot also split it or sum its gradient over tensor (mark its module skip)")


class _RankPieces:
    """This rank's piece of each weight, made once per parameter (tied weights share one piece)."""

    def __init__(self):
        self._made: dict[int, nn.Parameter] = {}

    def __call__(self, param: nn.Parameter, split: Split) -> nn.Parameter:
        key = id(param)
        if key not in self._made:
            new = nn.Parameter(split.piece(param.detach()).clone(), requires_grad=param.requires_grad)
            set_layout(new, ParamLayout(split=split))
            self._made[key] = new
        return self._made[key]


def _build_replacements(plan: TPPlan, modules: dict[str, nn.Module], rank: int, group) -> dict[str, nn.Module]:
    """The tensor-parallel module of this rank for every split module of the plan."""
    pieces = _RankPieces()
    # q/k/v of an attention whose input gradient is all-reduced once at its input copy nothing themselves
    shared_input = {n for a in plan.attention.values() if a.shared_input
                    for n, m in plan.modules.items() if m.style == COLUMN and n.rpartition(".")[0] == a.name}
    replacements: dict[str, nn.Module] = {}
    for name, mp in plan.modules.items():
        if mp.style == GRAD_SUM:
            continue
        new = _replacement(mp, modules[name], pieces, rank, group, copy_input=name not in shared_input)
        if new is not None:
            replacements[name] = new
    return replacements


def _replacement(mp: ModulePlan, mod: nn.Module, pieces: _RankPieces, rank: int, group,
                 copy_input: bool) -> nn.Module | None:
    split = Split("tensor", mp.weight_axis(), mp.sections, rank)
    weight = pieces(mod.weight, split)
    if mp.style == VOCAB_EMBED:
        return VocabParallelEmbedding(weight, group=group, rank=rank, split=split,
                                      num_embeddings=mod.num_embeddings, padding_idx=mod.padding_idx)
    fin, fout = features(mod, mp.kind)
    bias = getattr(mod, "bias", None)
    if bias is not None and mp.style in (COLUMN, COLUMN_GATHER, VOCAB_HEAD):
        bias = pieces(bias, Split("tensor", 0, mp.sections, rank))
    common = dict(group=group, rank=rank, split=split, kind=mp.kind, full_in=fin, full_out=fout)
    if mp.style in (COLUMN, COLUMN_GATHER):
        return ColumnParallelLinear(weight, bias, gather_output=mp.style == COLUMN_GATHER, copy_input=copy_input,
                                    **common)
    if mp.style in (ROW, ROW_SPLIT):
        return RowParallelLinear(weight, bias, split_input=mp.style == ROW_SPLIT, **common)
    if mp.style == VOCAB_HEAD:
        return VocabParallelLMHead(weight, bias, **common)
    return None


def _swap_in(model: nn.Module, modules: dict[str, nn.Module], replacements: dict[str, nn.Module]) -> None:
    for name, new in replacements.items():
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, new)


def _copy_hidden_states(group, _module, args, kwargs):
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = copy_to_tp(kwargs["hidden_states"], group)
    elif args:
        args = (copy_to_tp(args[0], group), *args[1:])
    return args, kwargs


def _localise_heads(attn: nn.Module, att: AttentionPlan, rank: int, group) -> None:
    q, kv = att.q_heads[rank], att.kv_heads[rank]
    for names, full, local in ((_HEAD_ATTRS, att.num_heads, q), (_KV_ATTRS, att.num_kv_heads, kv),
                               (_WIDTH_ATTRS, att.num_heads * att.head_dim, q * att.head_dim)):
        for a in names:
            v = attn.__dict__.get(a)
            if isinstance(v, int) and not isinstance(v, bool) and v == full:
                setattr(attn, a, local)
    cfg = attn.__dict__.get("config")
    if cfg is not None:
        overrides = {}
        for a in _HEAD_ATTRS:
            if isinstance(getattr(cfg, a, None), int):
                overrides[a] = q
        for a in _KV_ATTRS:
            if isinstance(getattr(cfg, a, None), int):
                overrides[a] = kv
        attn.config = LocalHeadsConfig(cfg, overrides)
    if att.shared_input:
        attn.register_forward_pre_hook(functools.partial(_copy_hidden_states, group), with_kwargs=True)
    if q == 0:
        attn.forward = functools.partial(_no_heads_forward, attn, att.out_proj.rpartition(".")[2])


def _install_vocab_loss(model: nn.Module, plan: TPPlan) -> None:
    """Keep the logits split when the owner of the lm_head is called with labels and computes its
    loss through ``self.loss_function`` (Hugging Face causal LMs); else the logits are gathered."""
    heads = [n for n, m in plan.modules.items() if m.style == VOCAB_HEAD]
    if not heads:
        return
    out_name = heads[0]
    owner_name = out_name.rpartition(".")[0]
    owner = model.get_submodule(owner_name) if owner_name else model
    head = model.get_submodule(out_name)
    if not hasattr(owner, "loss_function") or not _owner_uses_loss_function(owner):
        plan.notes.append(f"{owner_name or type(owner).__name__} does not compute its loss through loss_function: "
                          "its logits are gathered whole")
        return
    owner.loss_function = causal_lm_loss(owner.loss_function, head)

    def keep_local_with_labels(_module, args, kwargs):
        head.keep_local = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        return None

    owner.register_forward_pre_hook(keep_local_with_labels, with_kwargs=True)


def sum_partial_grads(model: nn.Module) -> None:
    """All-reduce, over the tensor group, the gradients that are partial there (``grad_sum="tensor"``).

    For training without an engine that reads layouts (ZeRO does this itself). A parameter that
    got no gradient on this rank (a rank that holds no heads) takes part with zeros.
    """
    import torch
    from polyaccel import comm

    model = getattr(model, "module", model)
    state: TPState | None = getattr(model, STATE_ATTR, None)
    if state is None or state.plan.tp == 1:
        return
    for name in state.plan.grad_sum:
        p = model.get_parameter(name)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        comm.all_reduce(p.grad, group=state.group)


__all__ = ["LocalHeadsConfig", "TPState", "apply_tensor_parallel", "get_plan", "sum_partial_grads"]
