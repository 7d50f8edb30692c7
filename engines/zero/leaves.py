"""Stage-3 leaf modules: subtrees gathered as one unit, for modules whose inside runs conditionally.

Stage 3 gathers a module's parameters when the module runs. If a submodule runs on some
ranks and not on others (an MoE expert that got no token here, a data-dependent branch),
the ranks would issue different gathers. A *leaf* module has no hooks inside it: its whole
subtree is gathered before it runs and released after, on every rank, whatever runs inside.

Leaves are, outermost first:

- modules named in ``zero_optimization.stage3_leaf_modules`` (a class name such as
  ``"MixtralSparseMoeBlock"`` or a module path such as ``"model.layers.0.mlp"``);
- modules marked with :func:`set_leaf_modules`;
- automatically, the outermost module that keeps per-expert modules (see :func:`is_expert_container`):
  a ``ModuleList``/``ModuleDict`` of experts on the MoE block, a wrapper inside the block that
  holds one (Hugging Face's ``mlp.experts`` replaced by a loop over per-expert modules), or
  numbered expert attributes (``expert_0``, ``expert_1``, ... reached with ``getattr``). The
  module that holds the experts is called on every rank, whichever experts it runs inside;
- with ``zero_optimization.stage3_module_granularity_threshold`` > 0, the largest modules whose
  subtree holds at most that many parameter elements (a decoder layer, say): one gather and one
  set of hooks per such module instead of one per linear layer and norm.
"""

from __future__ import annotations

import re

import torch
from polyaccel.errors import ConfigError, PolyaccelError

_MARK = "_polyaccel_zero_leaf"


class ScheduleMismatch(PolyaccelError, RuntimeError):
    """Ranks were about to issue different parameter gathers (or some had none left); raised on every rank at
    once, before any mismatched gather (see :mod:`.schedule`)."""


def set_leaf_modules(model: torch.nn.Module, targets) -> list[str]:
    """Mark modules of ``model`` as stage-3 leaves: classes, class names or module paths. Returns the paths
    marked; a target that matches nothing is an error naming it."""
    paths = []
    for path, module in _match(model, list(targets)).items():
        setattr(module, _MARK, True)
        paths.append(path)
    return paths


def _match(model: torch.nn.Module, targets: list) -> dict[str, torch.nn.Module]:
    modules = dict(model.named_modules())
    found: dict[str, torch.nn.Module] = {}
    for target in targets:
        if isinstance(target, type):
            hits = {p: m for p, m in modules.items() if isinstance(m, target)}
        elif isinstance(target, str):
            hits = {p: m for p, m in modules.items() if p == target or type(m).__name__ == target}
        else:
            raise ConfigError(f"a stage-3 leaf module is given as a class, a class name or a module path, "
                              f"got {target!r}")
        if not hits:
            classes = sorted({type(m).__name__ for m in modules.values()})
            raise ConfigError(
                f"stage-3 leaf module {getattr(target, '__name__', target)!r} matches no module of the model; "
                f"give a module path (e.g. 'model.layers.0.mlp') or one of its classes: {', '.join(classes)}")
        found.update(hits)
    return found


_EXPERT_WORD = re.compile("expert", re.IGNORECASE)
#: one expert kept as an attribute of its own: ``expert_3``, ``experts3``, ``local_expert_0``
_NUMBERED_EXPERT = re.compile(r"^(?:\w+_)?experts?_?\d+$", re.IGNORECASE)
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def _has_parameters(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def is_expert_container(name: str, module: torch.nn.Module) -> bool:
    """Whether ``module`` (called ``name`` in its parent) keeps per-expert modules, any of which may not run:

    - it holds a ``ModuleList``/``ModuleDict`` (with parameters) whose name says "expert" (``experts``,
      ``local_experts``, ``expert_list``): an MoE block in the per-expert layout;
    - it holds such a container under any name and its own name or class name says "expert" (a wrapper
      at ``mlp.experts`` holding ``mlps``, a class ``ExpertBank`` holding ``table``);
    - it has two or more numbered expert children (``expert_0``, ``expert_1``, ...), reached with
      ``getattr``.

    A module with fused expert weights (Hugging Face's ``Qwen3MoeExperts``: 3-D parameters, no
    submodules) is not one: its parameters are gathered with it whichever experts it computes.
    """
    containers = [n for n, c in module.named_children() if isinstance(c, _CONTAINERS) and _has_parameters(c)]
    if any(_EXPERT_WORD.search(n) for n in containers):
        return True
    if containers and (_EXPERT_WORD.search(name) or _EXPERT_WORD.search(type(module).__name__)):
        return True
    numbered = [n for n, c in module.named_children() if _NUMBERED_EXPERT.match(n) and _has_parameters(c)]
    return len(numbered) >= 2


def find_leaf_modules(model: torch.nn.Module, names=(), granularity: int = 0) -> dict[str, torch.nn.Module]:
    """The outermost leaves of ``model``, by path."""
    chosen = {id(m) for m in _match(model, list(names)).values()}
    leaves: dict[str, torch.nn.Module] = {}
    covered: set[int] = set()
    for path, module in model.named_modules():
        if id(module) in covered:
            continue
        if (id(module) in chosen or getattr(module, _MARK, False)
                or is_expert_container(path.rsplit(".", 1)[-1], module) or _small_enough(module, granularity)):
            leaves[path] = module
            covered.update(id(m) for m in module.modules())
    return leaves


def _small_enough(module: torch.nn.Module, granularity: int) -> bool:
    """A module with parameters in more than one submodule, all together at most ``granularity`` elements."""
    if granularity <= 0:
        return False
    owners = 0
    total = 0
    for m in module.modules():
        own = sum(p.numel() for p in m.parameters(recurse=False))
        owners += own > 0
        total += own
    return owners > 1 and total <= granularity
