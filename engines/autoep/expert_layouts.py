"""Recognise how a MoE block stores its experts, and read their sizes.

Two layouts are run by AutoEP, each read by its own function:

- :func:`_fused_layout`: transformers >= 5 fused 3-D parameters, ``gate_up_proj`` [E, 2F, H] and
  ``down_proj`` [E, H, F] (or the transposed [E, H, 2F] / [E, F, H] when the module says
  ``is_transposed``), gate and up concatenated, no biases, SiLU;
- :func:`_module_list_layout`: an ``nn.ModuleList`` of per-expert MLPs with three bias-free
  linears (gate, up, down), named as in :data:`MODULE_LIST_PROJECTIONS` or by the
  ``expert_w1/w2/w3`` keys.

Anything else raises :class:`LayoutError` saying what was found and which key to set. Only reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from polyaccel.errors import ConfigError

from .config import SECTION, AutoEPConfig

FUSED, FUSED_T, MODULE_LIST = "fused 3-D", "fused 3-D transposed", "ModuleList"
MODULE_LIST_PROJECTIONS = (("gate_proj", "down_proj", "up_proj"), ("w1", "w2", "w3"))  # (gate, down, up)


class LayoutError(ConfigError):
    """A MoE block whose layout AutoEP does not recognise; the message says what was found."""


@dataclass(frozen=True)
class ExpertsLayout:
    """What one experts child holds."""

    layout: str  # FUSED | FUSED_T | MODULE_LIST
    num_experts: int
    ffn_size: int
    dtype: torch.dtype  # of the expert weights
    projections: tuple[str, str, str] | None = None  # ModuleList: (gate, down, up) child names


def children(module) -> dict:
    return dict(module.named_children())


def _is_silu(act) -> bool:
    return act is not None and type(act).__name__ in ("SiLU", "SiLUActivation", "SwishActivation")


def _describe_params(module, limit: int = 6) -> str:
    items = [f"{n} {list(p.shape)}" for n, p in list(module.named_parameters())[:limit]]
    return ", ".join(items) or "no parameters"


def read_experts(name: str, experts, H: int, cfg: AutoEPConfig) -> ExpertsLayout:
    """The layout of block ``name``'s experts child, whose router gives hidden size ``H``."""
    if isinstance(experts, torch.nn.ModuleList):
        return _module_list_layout(name, experts, H, cfg)
    return _fused_layout(name, experts, H)


# --- fused 3-D experts (transformers >= 5) ---------------------------------------------------------------------


def _fused_weights(where: str, experts) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_proj, down_proj), both 3-D; any other experts module is neither layout."""
    gu = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor) or gu.dim() != 3 or down.dim() != 3:
        raise LayoutError(
            f"{where} is neither fused 3-D experts (gate_up_proj [E, 2F, H] and down_proj [E, H, F], "
            f"transformers >= 5) nor a ModuleList of per-expert MLPs; found {_describe_params(experts)}. "
            f"Set '{SECTION}.expert_pattern' to the experts child, '{SECTION}.expert_w1/expert_w2/expert_w3' to a "
            f"ModuleList expert's gate/down/up projections, or '{SECTION}.moe_layer_pattern' to leave this "
            "module out")
    return gu, down


def _fused_unsupported(experts) -> list[str]:
    """The features of fused experts that AutoEP's SwiGLU grouped experts cannot run."""
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
    return unsupported


def _fused_sizes(where: str, gu: torch.Tensor, down: torch.Tensor, transposed: bool, H: int) -> tuple[int, int]:
    """(num_experts, ffn) of the fused weights, checked against each other and hidden size ``H``."""
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
    return E, two_f // 2


def _fused_layout(name: str, experts, H: int) -> ExpertsLayout:
    """Transformers-5 fused experts; raises LayoutError for anything else."""
    where = f"{name}.experts ({type(experts).__name__})"
    gu, down = _fused_weights(where, experts)
    unsupported = _fused_unsupported(experts)
    if unsupported:
        raise LayoutError(f"{where}: fused experts with {', '.join(unsupported)} are not supported by AutoEP; "
                          f"set '{SECTION}.moe_layer_pattern' to leave this module out")
    transposed = bool(getattr(experts, "is_transposed", False))
    E, F = _fused_sizes(where, gu, down, transposed, H)
    return ExpertsLayout(FUSED_T if transposed else FUSED, E, F, gu.dtype)


# --- a ModuleList of per-expert MLPs ---------------------------------------------------------------------------


def _module_list_projections(where: str, first, cfg: AutoEPConfig) -> tuple[str, str, str]:
    """The (gate, down, up) child names of expert 0: the configured ones, else the first known naming."""
    kids = children(first)
    candidates = ((cfg.expert_w1, cfg.expert_w2, cfg.expert_w3),) if cfg.expert_w1 else MODULE_LIST_PROJECTIONS
    proj = next((c for c in candidates if all(isinstance(kids.get(n), torch.nn.Linear) for n in c)), None)
    if proj is None:
        tried = " or ".join("/".join(c) for c in candidates)
        raise LayoutError(
            f"{where}[0] ({type(first).__name__}) has children {sorted(kids) or 'none'} ({_describe_params(first)}); "
            f"AutoEP looked for three nn.Linear projections named {tried} (gate/down/up). Set "
            f"'{SECTION}.expert_w1', 'expert_w2' and 'expert_w3' to the gate, down and up projection names")
    return proj


def _check_expert_mlp(where: str, expert, proj: tuple[str, str, str], H: int, F: int) -> None:
    """One expert (``where`` is ``block.experts[i]``) is a bias-free SiLU MLP of expert 0's shape."""
    g, d, u = proj
    kids = children(expert)
    for n, (fin, fout) in ((g, (H, F)), (u, (H, F)), (d, (F, H))):
        lin = kids.get(n)
        if not isinstance(lin, torch.nn.Linear) or (lin.in_features, lin.out_features) != (fin, fout):
            raise LayoutError(f"{where}.{n} is not an nn.Linear({fin}, {fout}) like expert 0's "
                              "(experts must share one shape)")
        if lin.bias is not None:
            raise LayoutError(f"{where}.{n} has a bias; AutoEP's grouped experts have none")
    act = getattr(expert, "act_fn", None)
    if act is not None and not _is_silu(act):
        raise LayoutError(f"{where} uses activation {type(act).__name__}; AutoEP runs SwiGLU (SiLU)")


def _module_list_layout(name: str, experts, H: int, cfg: AutoEPConfig) -> ExpertsLayout:
    where = f"{name}.experts"
    if len(experts) == 0:
        raise LayoutError(f"{where} is an empty ModuleList")
    proj = _module_list_projections(where, experts[0], cfg)
    gate = children(experts[0])[proj[0]]
    F = gate.out_features
    for i, e in enumerate(experts):
        _check_expert_mlp(f"{where}[{i}]", e, proj, H, F)
    return ExpertsLayout(MODULE_LIST, len(experts), F, gate.weight.dtype, proj)
