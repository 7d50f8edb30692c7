"""Which parameters Muon steps, and how: the one rule ``MuonWithAuxAdam`` and the ZeRO engine share.

Muon orthogonalizes *hidden matrices*: the 2-D weights of linear-like modules (``nn.Linear``,
transformers' ``Conv1D``) inside the network. Everything else goes to the auxiliary Adam:
embeddings (``nn.Embedding`` and whatever ``get_input_embeddings()`` returns), the output head
(``get_output_embeddings()``, a module named ``lm_head``, any weight tied to an embedding), norms,
biases, every tensor that is not 2-D and every 2-D one with a dimension of 1 (a vector).
``muon=`` / ``adam=`` patterns (fnmatch over ``named_parameters()`` names) override the rule.

``per_head=True`` orthogonalizes attention projections one head at a time. The head geometry is
read from the module that owns the projections, never guessed from shapes:

* softmax attention with ``q_proj``/``k_proj``/``v_proj``/``o_proj`` children (Llama, Mistral,
  Qwen, Kimi's delta attention, Qwen3-Next's gated attention whose ``q_proj`` holds per head its
  query and its output gate, ...): the head count from the module's ``num_heads`` /
  ``num_attention_heads`` or its ``config.num_attention_heads``; the key-value head count (GQA)
  from ``num_key_value_heads`` / ``num_kv_heads`` / ``num_key_value_groups`` or the config; the
  head size from ``head_dim`` (module, then config) where one is given;
* GPT-2's fused ``c_attn`` (``Conv1D``, output columns q|k|v) and ``c_proj``;
* Qwen3-Next's gated delta net (linear attention): ``in_proj_qkvz`` is laid out per key head
  (each group of rows holds one key head's q, k and its value heads' v, z), so it is cut into
  ``num_k_heads`` blocks; ``out_proj`` into ``num_v_heads`` column blocks.

A split is ``(dim, heads)`` of the stored weight: q/k/v cut rows (``dim 0``) of an ``nn.Linear``
weight and the output projection its columns (``dim 1``); ``Conv1D`` stores ``(in, out)``, so
there the dims swap.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .errors import InvalidArgument


class MuonParamsError(InvalidArgument):
    """A ``muon=``/``adam=`` pattern or a head geometry that cannot be honoured; the message names it."""


@dataclass(frozen=True)
class MuonChoice:
    muon: bool                           # stepped by Muon (else by the auxiliary Adam)
    head_split: tuple[int, int] | None   # (dim, heads) for per-head Newton-Schulz, None: the whole matrix
    reason: str                          # one line: why (shown by a report / errors)


#: child names of the four projections of a softmax-attention module
_QKVO = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}
_HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_KV_HEADS_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def _conv1d_class():
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # noqa: BLE001 - transformers absent or broken: no Conv1D modules to find
        return None
    return Conv1D


def _linear_kind(module: nn.Module) -> str | None:
    """"linear" ((out, in) weight), "conv1d" ((in, out) weight) or None for other modules."""
    if isinstance(module, nn.Linear):
        return "linear"
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return "conv1d"
    return None


def _attr(obj, names) -> int | None:
    for name in names:
        v = getattr(obj, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


# ----------------------------------------------------------------------------- head geometry
def _split(module: nn.Module, role_dim: int, heads: int) -> tuple[int, int]:
    """``role_dim`` is the dim of an ``nn.Linear`` weight the heads lie along; Conv1D swaps it."""
    return (1 - role_dim if _linear_kind(module) == "conv1d" else role_dim), heads


def _check_size(where: str, module: nn.Module, dim: int, heads: int, head_dim: int | None, what: str,
                per_head: tuple[int, ...] = (1,)) -> None:
    """The weight's ``dim`` is ``heads * head_dim`` (times one of ``per_head``: a gated query holds two
    rows per head row), or at least a multiple of ``heads`` where the module gives no head size."""
    size = module.weight.shape[dim]
    allowed = [heads * head_dim * k for k in per_head] if head_dim is not None else None
    if (allowed is not None and size not in allowed) or size % heads:
        want = (" or ".join(map(str, allowed)) + f" ({heads} heads x head_dim {head_dim})"
                if allowed is not None else f"a multiple of {heads} heads")
        raise MuonParamsError(
            f"per_head: {where} has {size} {what} but its attention module gives {want}; fix the module's head "
            f"attributes, or keep this weight whole (per_head=False, or adam=['{where}'])")


def _softmax_attention_splits(name: str, module: nn.Module, children: dict) -> dict[str, tuple[int, int]]:
    config = getattr(module, "config", None)
    heads = _attr(module, _HEADS_ATTRS)
    if heads is not None:  # the module's own geometry (a linear-attention layer's may differ from the config's)
        kv = _attr(module, _KV_HEADS_ATTRS)
        groups = _attr(module, ("num_key_value_groups",))
        kv = kv or (heads // groups if groups else heads)
        head_dim = _attr(module, ("head_dim",))
    else:
        heads = _attr(config, ("num_attention_heads",)) if config is not None else None
        if heads is None:
            raise MuonParamsError(
                f"per_head: attention module '{name}' ({type(module).__name__}) gives no head count (no "
                f"{'/'.join(_HEADS_ATTRS)} attribute, no config.num_attention_heads); set one, or use per_head=False")
        groups = _attr(module, ("num_key_value_groups",))
        kv = _attr(config, ("num_key_value_heads",)) or (heads // groups if groups else heads)
        head_dim = _attr(module, ("head_dim",)) or _attr(config, ("head_dim",))
    qk_dim = _attr(module, ("qk_head_dim",)) or head_dim
    v_dim = _attr(module, ("v_head_dim",)) or head_dim
    out: dict[str, tuple[int, int]] = {}
    for child, role in _QKVO.items():
        mod = children.get(child)
        if mod is None:
            continue
        where = f"{name}.{child}.weight" if name else f"{child}.weight"
        n = heads if role in ("q", "o") else kv
        d = qk_dim if role in ("q", "k") else v_dim
        split = _split(mod, 1 if role == "o" else 0, n)
        # a gated query (Qwen3-Next) holds each head's query and its output gate: 2 * head_dim rows a head
        _check_size(where, mod, split[0], n, d, "input features" if role == "o" else "output features",
                    (1, 2) if role == "q" else (1,))
        out[where] = split
    return out


def _gpt2_attention_splits(name: str, module: nn.Module, children: dict) -> dict[str, tuple[int, int]]:
    heads = _attr(module, _HEADS_ATTRS)
    if heads is None:
        raise MuonParamsError(f"per_head: attention module '{name}' ({type(module).__name__}) has a fused c_attn "
                              "but no num_heads attribute; set one, or use per_head=False")
    head_dim = _attr(module, ("head_dim",))
    prefix = f"{name}." if name else ""
    out = {}
    c_attn = children["c_attn"]
    fused = 2 if "q_attn" in children else 3  # k|v with a separate q_attn (cross attention), else q|k|v
    split = _split(c_attn, 0, fused * heads)  # output features, head by head
    _check_size(f"{prefix}c_attn.weight", c_attn, split[0], fused * heads, head_dim, "output features")
    out[f"{prefix}c_attn.weight"] = split
    for child, role_dim in (("q_attn", 0), ("c_proj", 1)):
        mod = children.get(child)
        if mod is not None and _linear_kind(mod):
            split = _split(mod, role_dim, heads)
            _check_size(f"{prefix}{child}.weight", mod, split[0], heads, head_dim,
                        "input features" if role_dim else "output features")
            out[f"{prefix}{child}.weight"] = split
    return out


def _gated_delta_net_splits(name: str, module: nn.Module, children: dict) -> dict[str, tuple[int, int]]:
    nk, nv = module.num_k_heads, module.num_v_heads
    dk, dv = _attr(module, ("head_k_dim",)), _attr(module, ("head_v_dim",))
    prefix = f"{name}." if name else ""
    out = {}
    qkvz = children.get("in_proj_qkvz")
    if qkvz is not None and _linear_kind(qkvz):
        per_group = None if dk is None or dv is None else 2 * dk + 2 * dv * nv // nk
        split = _split(qkvz, 0, nk)
        _check_size(f"{prefix}in_proj_qkvz.weight", qkvz, split[0], nk, per_group, "output features")
        out[f"{prefix}in_proj_qkvz.weight"] = split
    proj = children.get("out_proj")
    if proj is not None and _linear_kind(proj):
        split = _split(proj, 1, nv)
        _check_size(f"{prefix}out_proj.weight", proj, split[0], nv, dv, "input features")
        out[f"{prefix}out_proj.weight"] = split
    return out


def head_splits(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{weight name: (dim, heads)}`` for every attention projection whose module gives its geometry.

    Names are module paths plus ``.weight`` (the names ``named_parameters()`` gives an untied weight).
    """
    out: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        children = dict(module.named_children())
        linear = {k: m for k, m in children.items() if _linear_kind(m)}
        if _attr(module, ("num_k_heads",)) and _attr(module, ("num_v_heads",)) and "in_proj_qkvz" in linear:
            out.update(_gated_delta_net_splits(name, module, linear))
        elif "c_attn" in linear:
            out.update(_gpt2_attention_splits(name, module, linear))
        elif any(c in linear for c in _QKVO) and ("q_proj" in linear or "k_proj" in linear):
            out.update(_softmax_attention_splits(name, module, linear))
    return out


# ----------------------------------------------------------------------------- the rule
def _modules_of(model: nn.Module, getter: str) -> list[nn.Module]:
    fn = getattr(model, getter, None)
    if not callable(fn):
        return []
    try:
        mod = fn()
    except (NotImplementedError, AttributeError):
        return []
    return [mod] if isinstance(mod, nn.Module) else []


def _default_choice(pname: str, param: torch.Tensor, owner: nn.Module, owner_name: str, embeddings: set[int],
                    heads: set[int]) -> MuonChoice:
    if id(param) in embeddings:
        return MuonChoice(False, None, "an embedding (input embeddings or a weight tied to them): Adam")
    if id(param) in heads:
        return MuonChoice(False, None, "the output head (get_output_embeddings() or lm_head): Adam")
    if param.dim() != 2:
        return MuonChoice(False, None, f"a {param.dim()}-D tensor (Muon orthogonalizes matrices): Adam")
    if min(param.shape) <= 1:
        return MuonChoice(False, None, f"a {tuple(param.shape)} weight is a vector (a gate or a scalar head): Adam")
    kind = _linear_kind(owner)
    if kind is None:
        return MuonChoice(False, None, f"a 2-D tensor of {type(owner).__name__} '{owner_name}', not a linear "
                                       "layer's weight: Adam")
    if not pname.endswith(".weight") and pname != "weight":
        return MuonChoice(False, None, f"not the weight of {type(owner).__name__} '{owner_name}': Adam")
    return MuonChoice(True, None, f"a hidden matrix (the weight of {type(owner).__name__} '{owner_name}'): Muon")


def _match(patterns, names, what: str) -> dict[str, str]:
    """``{name: the first pattern matching it}``; a pattern matching nothing is an error naming it."""
    hit: dict[str, str] = {}
    for pat in patterns:
        matched = [n for n in names if fnmatch.fnmatchcase(n, pat)]
        if not matched:
            raise MuonParamsError(f"{what}={pat!r} matches no parameter of the model (names look like "
                                  f"{names[0]!r}); fix the pattern or drop it" if names else
                                  f"{what}={pat!r}: the model has no parameters")
        for n in matched:
            hit.setdefault(n, pat)
    return hit


def choose_muon_params(model: torch.nn.Module, *, per_head: bool = False,
                       muon: Iterable[str] = (), adam: Iterable[str] = ()) -> dict[str, MuonChoice]:
    """``{name: MuonChoice}`` for every parameter of ``model`` (``named_parameters()`` names, in that order).

    See the module docstring for the rule. ``muon`` / ``adam``: fnmatch patterns over the names that
    force a parameter to Muon / to Adam; a pattern matching nothing, a name matched by both, or a
    tensor that is not 2-D forced into Muon is an error naming it. ``per_head=True`` gives the
    q/k/v/o projections of attention modules their head splits (Muon parameters only).
    """
    if isinstance(muon, str) or isinstance(adam, str):
        raise MuonParamsError("choose_muon_params: muon= and adam= take a list of patterns, not one string "
                              "(write muon=['blocks.*'])")
    named = list(model.named_parameters())
    names = [n for n, _ in named]
    forced_muon = _match(list(muon), names, "muon")
    forced_adam = _match(list(adam), names, "adam")
    both = sorted(set(forced_muon) & set(forced_adam))
    if both:
        raise MuonParamsError(f"parameter {both[0]!r} is matched by muon={forced_muon[both[0]]!r} and by "
                              f"adam={forced_adam[both[0]]!r}; make the patterns exclusive")
    owners, embeddings, heads = _roles(model)
    splits = head_splits(model) if per_head else {}
    out: dict[str, MuonChoice] = {}
    for pname, p in named:
        owner_name, owner = owners[id(p)]
        if pname in forced_adam:
            choice = MuonChoice(False, None, f"forced to Adam by adam={forced_adam[pname]!r}")
        elif pname in forced_muon:
            choice = _forced_muon(pname, p, forced_muon[pname])
        else:
            choice = _default_choice(pname, p, owner, owner_name, embeddings, heads)
        if choice.muon and pname in splits:
            dim, n = splits[pname]
            choice = MuonChoice(True, (dim, n), f"{choice.reason}, per head ({n} blocks along dim {dim})")
        out[pname] = choice
    return out


def _forced_muon(pname: str, p: torch.Tensor, pattern: str) -> MuonChoice:
    if p.dim() != 2:
        raise MuonParamsError(f"muon={pattern!r} forces parameter {pname!r} of shape {tuple(p.shape)} into "
                              "Muon, which steps 2-D matrices only; narrow the pattern")
    return MuonChoice(True, None, f"forced to Muon by muon={pattern!r}")


def _roles(model: nn.Module) -> tuple[dict[int, tuple[str, nn.Module]], set[int], set[int]]:
    """(parameter id -> (name, module) of the module owning it, ids of embedding parameters, ids of output
    heads' weights)."""
    owners: dict[int, tuple[str, nn.Module]] = {}
    for mname, module in model.named_modules():
        for _, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), (mname, module))
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    embeddings |= {id(p) for m in _modules_of(model, "get_input_embeddings") for p in m.parameters()}
    heads = {id(m.weight) for m in _modules_of(model, "get_output_embeddings") if isinstance(
        getattr(m, "weight", None), torch.Tensor)}
    heads |= {id(m.weight) for n, m in model.named_modules()
              if n.rsplit(".", 1)[-1] == "lm_head" and isinstance(getattr(m, "weight", None), torch.Tensor)}
    return owners, embeddings, heads


def muon_report(choices: dict[str, MuonChoice]) -> str:
    """One line per parameter: Muon / Adam, its head split and why."""
    width = max((len(n) for n in choices), default=0)
    lines = []
    for name, c in choices.items():
        split = f" split {c.head_split}" if c.head_split else ""
        lines.append(f"{name:<{width}}  {'muon' if c.muon else 'adam'}{split}  {c.reason}")
    return "\n".join(lines)


__all__ = ["MuonChoice", "MuonParamsError", "choose_muon_params", "head_splits", "muon_report"]
