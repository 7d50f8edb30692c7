"""Per-parameter weight decay: the engine's ``param_groups`` and the runs of a partition they give.

The engine keeps one flat partition per layout kind (its checkpoint format depends on that), so a
parameter group is not a separate buffer here. Instead each parameter gets a weight decay (its group's,
else the config's ``optimizer.params.weight_decay``) and the optimizer steps each slice of its partition
as a few multi-tensor calls, one per distinct weight decay, over the contiguous runs that share it
(:func:`decay_runs`). Without groups, or when every parameter has the same decay, there is one run and the
step is exactly the single call it always was.

``param_groups`` takes torch's shape, restricted to what the engine can vary per parameter::

    [{"params": [...], "weight_decay": 0.0, "name": "no_decay"}, ...]

``params`` holds the model's parameters (the tensors, matched by identity) or their names (as
``model.named_parameters()`` spells them; a tied weight by any of its names). A group without
``weight_decay`` gets the config's; parameters in no group keep the config's too. Every other key (``lr``,
``betas`` ...) is refused: the engine has one set of those, in the config's ``optimizer`` section.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from polyaccel.config_check import number_value
from polyaccel.errors import ConfigError

GROUP_KEYS = ("params", "weight_decay", "name")


def _where(i: int, group: Mapping) -> str:
    name = group.get("name")
    return f"param_groups[{i}]" + (f" ({name!r})" if isinstance(name, str) else "")


def _decay(where: str, group: Mapping, default: float) -> float:
    if "weight_decay" not in group:
        return default
    wd = group["weight_decay"]
    value = number_value(wd)  # polyaccel.config_check's number rule: finite, not a bool
    if value is None or value < 0:
        raise ConfigError(f"{where}: 'weight_decay' must be a finite number >= 0, got {wd!r}")
    return value


def _members(where: str, params) -> list:
    if isinstance(params, (str, torch.Tensor)):
        return [params]
    if isinstance(params, Mapping) or not isinstance(params, Iterable):
        raise ConfigError(f"{where}: 'params' must be a list of the model's parameters or of their names, "
                          f"got {type(params).__name__}")
    return list(params)


def _check_group(i: int, group) -> str:
    """Refuse a group that is not a dict of known keys with ``params``; return how errors name it."""
    if not isinstance(group, Mapping):
        raise ConfigError(f"param_groups[{i}] must be a dict like {{'params': [...], 'weight_decay': 0.0}}, "
                          f"got {type(group).__name__}")
    where = _where(i, group)
    unknown = sorted(str(k) for k in group if k not in GROUP_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(repr(k) for k in unknown)}; a group takes "
                          f"{', '.join(GROUP_KEYS)} (the engine has one lr, betas and eps: set them in the "
                          "config's 'optimizer' section)")
    if "params" not in group:
        raise ConfigError(f"{where}: missing 'params' (the model's parameters or their names)")
    if "name" in group and not isinstance(group["name"], str):
        raise ConfigError(f"{where}: 'name' must be a string, got {type(group['name']).__name__}")
    return where


def _member_name(where: str, j: int, p, by_id: Mapping[int, str], names: set[str],
                 aliases: Mapping[str, str]) -> str:
    """The canonical name of a group's ``params[j]``: a parameter of the model or one of its names."""
    if isinstance(p, str):
        name = aliases.get(p, p)
        if name not in names:
            raise ConfigError(f"{where}: {p!r} is not a parameter of the model; name parameters as "
                              "model.named_parameters() does")
        return name
    if isinstance(p, torch.Tensor):
        name = by_id.get(id(p))
        if name is None:
            raise ConfigError(f"{where}: params[{j}] (a tensor of shape {tuple(p.shape)}) is not a parameter "
                              "of the model the engine wraps; pass the model's own parameters, or their "
                              "names where a layer such as tensor_parallel replaced them")
        return name
    raise ConfigError(f"{where}: params[{j}] must be a parameter of the model or its name, "
                      f"got {type(p).__name__}")


def resolve_param_groups(groups, named: list[tuple[str, torch.Tensor]], aliases: Mapping[str, str],
                         trainable: set[str], default: float) -> dict[str, float]:
    """``{name: weight decay}`` for every trainable parameter a group names (the rest keep ``default``).

    ``named``: every parameter of the model once, by its canonical name; ``aliases``: other names of tied
    parameters. Reads ``groups`` only; a bad group raises a :class:`ConfigError` naming it and the fix."""
    if groups is None:
        return {}
    if isinstance(groups, (Mapping, str, torch.Tensor)) or not isinstance(groups, Iterable):
        raise ConfigError(f"param_groups must be a list of dicts like {{'params': [...], 'weight_decay': 0.0}}, "
                          f"got {type(groups).__name__}")
    by_id = {id(p): n for n, p in named}
    names = {n for n, _ in named}
    owner: dict[str, int] = {}
    out: dict[str, float] = {}
    for i, group in enumerate(list(groups)):
        where = _check_group(i, group)
        wd = _decay(where, group, default)
        for j, p in enumerate(_members(where, group["params"])):
            name = _member_name(where, j, p, by_id, names, aliases)
            first = owner.setdefault(name, i)
            if first != i:
                raise ConfigError(f"parameter {name!r} is in param_groups[{first}] and in {where}; put each "
                                  "parameter in one group")
            if name in trainable:
                out[name] = wd
    return out


def decay_runs(ranges: list[tuple[int, int, int]], names: list[str], decay: Mapping[str, float],
               default: float) -> list[tuple[int, int, float]]:
    """Merge a partition's ``(lo, hi, parameter index)`` ranges (in order; index ``len(names)`` marks padding)
    into maximal ``(lo, hi, weight decay)`` runs covering it. Padding holds zeros with zero gradients, which
    any decay leaves at zero, so it joins a neighbouring run."""
    runs: list[list] = []
    for lo, hi, i in ranges:
        if hi <= lo:
            continue
        wd = None if i >= len(names) else decay.get(names[i], default)
        if runs and runs[-1][1] == lo and (wd is None or runs[-1][2] is None or runs[-1][2] == wd):
            runs[-1][1] = hi
            if runs[-1][2] is None:
                runs[-1][2] = wd
        else:
            runs.append([lo, hi, wd])
    merged: list[list] = []
    for run in runs:  # a padding run first took the decay of what followed it: merge equal neighbours again
        if run[2] is None:
            run[2] = default
        if merged and merged[-1][1] == run[0] and merged[-1][2] == run[2]:
            merged[-1][1] = run[1]
        else:
            merged.append(run)
    return [(lo, hi, wd) for lo, hi, wd in merged]
