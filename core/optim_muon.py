"""``Muon`` and ``MuonWithAuxAdam``: ``torch.optim.Optimizer`` front-ends for the ``fused_muon`` op.

``Muon`` is ``torch.optim.Muon`` (same arguments, defaults, state name and arithmetic) through
``polyaccel.ops.fused_muon``, so a plugin's builder (the cuda plugin's Triton Newton-Schulz, say)
serves it; one op call per param group and device. ``MuonWithAuxAdam`` steps a model's hidden
matrices with Muon and everything else (embeddings, the head, norms, biases) with AdamW through
``polyaccel.ops.fused_adam``: which is which is :func:`polyaccel.muon_params.choose_muon_params`,
or the ``use_muon`` flag of explicit param groups.

State: ``momentum_buffer`` per Muon parameter, float32 for 16-bit parameters (the momentum
accumulates in float32 under bf16; ``torch.optim.Muon`` keeps it in the gradient's dtype); the
Adam parameters keep ``step``, ``exp_avg`` and ``exp_avg_sq`` as :class:`polyaccel.optim.FusedAdam`
does. ``load_state_dict`` keeps float32 states float32 (torch's default would cast them to a
16-bit parameter's dtype).

A Muon group may carry ``head_splits``: one entry per parameter, None or ``(dim, heads)``
(per-head Newton-Schulz, see the ``fused_muon`` op). Hyperparameters are checked at construction
and again at each ``step()``, for every group, before any state or parameter changes.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from . import ops
from .errors import InvalidArgument, OpError
from .ops import contract, contract_muon
from .ops.reference.muon import NS_COEFFICIENTS, NS_EPS, NS_STEPS, check_split
from .optim_state import load_state_dict_keeping_dtypes, state_dtype

#: adjust_lr_fn -> the fused_muon op's lr_adjustment (torch.optim.Muon's names; None is "original")
LR_ADJUSTMENT = {None: "original", "original": "original", "match_rms_adamw": "match_rms_adamw"}


def check_muon_group(name: str, group: dict) -> None:
    """The ``fused_muon`` contract's rules for one Muon param group's values (and its parameters' shapes)."""
    contract.check_lr(name, group["lr"])
    contract.check_beta(name, group["momentum"], "momentum")
    contract.check_weight_decay(name, group["weight_decay"])
    if not isinstance(group["nesterov"], bool):
        raise InvalidArgument(f"{name}: nesterov must be True or False, got {group['nesterov']!r}")
    contract_muon.check_ns_settings(name, group["ns_steps"], group["ns_coefficients"], group["eps"], "ns_steps",
                                    "ns_coefficients")
    if group["adjust_lr_fn"] not in LR_ADJUSTMENT:
        raise InvalidArgument(f"{name}: adjust_lr_fn={group['adjust_lr_fn']!r} is not one of None, 'original', "
                              "'match_rms_adamw'")
    if group["ns_dtype"] not in contract_muon.NS_DTYPES:
        raise InvalidArgument(f"{name}: ns_dtype={group['ns_dtype']!r} is not one of "
                              f"{', '.join(map(str, contract_muon.NS_DTYPES))}")
    params, splits = group["params"], group.get("head_splits")
    for i, p in enumerate(params):
        if p.dim() != 2:
            raise InvalidArgument(f"{name}: parameter {i} of a Muon group has shape {tuple(p.shape)}; Muon steps "
                                  "2-D matrices only (put it in an Adam group: MuonWithAuxAdam, use_muon=False)")
    if splits is not None:
        if not isinstance(splits, (list, tuple)) or len(splits) != len(params):
            raise InvalidArgument(f"{name}: head_splits must list one entry (None or (dim, heads)) per parameter of "
                                  f"the group ({len(params)})")
        for i, (p, split) in enumerate(zip(params, splits, strict=True)):
            check_split(name, i, p.shape, split)


def check_adam_group(name: str, group: dict) -> None:
    contract.check_lr(name, group["lr"])
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise InvalidArgument(f"{name}: betas={betas!r} is not allowed; betas must be two values in [0, 1)")
    contract.check_beta(name, betas[0], "betas[0]")
    contract.check_beta(name, betas[1], "betas[1]")
    contract.check_eps(name, group["eps"])
    contract.check_weight_decay(name, group["weight_decay"])


class _MuonOptimizer(torch.optim.Optimizer):
    """The Muon and the Adam group steps; a subclass says which groups are which (``use_muon``)."""

    def load_state_dict(self, state_dict: dict) -> None:
        load_state_dict_keeping_dtypes(self, super().load_state_dict, state_dict)

    def _check(self, group) -> None:
        name = type(self).__name__
        (check_muon_group if group.get("use_muon", True) else check_adam_group)(name, group)

    def _grad(self, p):
        if p.grad is None:
            return None
        if p.grad.is_sparse:
            raise OpError(f"{type(self).__name__} does not support sparse gradients")
        return p.grad

    def _step_muon(self, group) -> None:
        batches = defaultdict(lambda: ([], [], [], []))
        splits = group.get("head_splits")
        for i, p in enumerate(group["params"]):
            g = self._grad(p)
            if g is None:
                continue
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)
            lists = batches[p.device]
            lists[0].append(p)
            lists[1].append(g)
            lists[2].append(st["momentum_buffer"])
            lists[3].append(None if splits is None else splits[i])
        for params, grads, bufs, heads in batches.values():
            ops.fused_muon(params, grads, bufs, lr=group["lr"], momentum=group["momentum"],
                           weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                           ns_steps=group["ns_steps"], ns_coefficients=tuple(group["ns_coefficients"]),
                           eps=group["eps"], ns_dtype=group["ns_dtype"],
                           lr_adjustment=LR_ADJUSTMENT[group["adjust_lr_fn"]],
                           head_splits=None if all(h is None for h in heads) else heads)

    def _step_adam(self, group) -> None:
        batches = defaultdict(lambda: ([], [], [], []))
        for p in group["params"]:
            g = self._grad(p)
            if g is None:
                continue
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)
            st["step"] += 1
            if p.numel() == 0:
                continue
            lists = batches[(p.device, int(st["step"].item()))]
            for lst, t in zip(lists, (p, g, st["exp_avg"], st["exp_avg_sq"]), strict=True):
                lst.append(t)
        b1, b2 = group["betas"]
        for (_, step), lists in batches.items():
            ops.fused_adam(*lists, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                           weight_decay=group["weight_decay"], step=step, adam_w_mode=True, bias_correction=True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._check(group)
        for group in self.param_groups:
            (self._step_muon if group.get("use_muon", True) else self._step_adam)(group)
        return loss


def _muon_defaults(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn, ns_dtype):
    return dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                ns_dtype=ns_dtype)


class Muon(_MuonOptimizer):
    """``torch.optim.Muon`` through the ``fused_muon`` op (all parameters 2-D; ``ns_dtype``: the iteration's dtype).

    A param group may add ``head_splits`` (one ``None`` or ``(dim, heads)`` per parameter) for
    per-head Newton-Schulz.
    """

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS, ns_steps=NS_STEPS, adjust_lr_fn=None,
                 ns_dtype=torch.bfloat16):
        defaults = _muon_defaults(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
                                  adjust_lr_fn, ns_dtype)
        check_muon_group(type(self).__name__, {**defaults, "params": []})
        super().__init__(params, defaults)
        for group in self.param_groups:
            self._check(group)


class MuonWithAuxAdam(_MuonOptimizer):
    """Muon for a model's hidden matrices, AdamW (``fused_adam``) for the rest, in one optimizer.

    ``model_or_param_groups``: an ``nn.Module``, whose parameters are split by
    :func:`polyaccel.muon_params.choose_muon_params` (``per_head``, ``muon`` and ``adam`` are
    passed to it; the Muon group gets the head splits), or a list of param-group dicts each with
    ``use_muon: True`` or ``False`` (as the community ``MuonWithAuxAdam``); a group's missing
    values come from the keyword arguments (``lr``, ``momentum``, ``weight_decay``, ... for Muon
    groups; ``adam_lr``, ``adam_betas``, ``adam_eps``, ``adam_weight_decay`` as ``lr``, ``betas``,
    ``eps``, ``weight_decay`` for Adam groups). Defaults are the community's: Muon lr 0.02,
    momentum 0.95, no weight decay; Adam lr 3e-4, betas (0.9, 0.95), eps 1e-10, no weight decay.
    """

    def __init__(self, model_or_param_groups, *, lr=0.02, momentum=0.95, weight_decay=0.0, adam_lr=3e-4,
                 adam_betas=(0.9, 0.95), adam_eps=1e-10, adam_weight_decay=0.0, per_head=False, muon=(), adam=(),
                 nesterov=True, ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS, ns_steps=NS_STEPS, adjust_lr_fn=None,
                 ns_dtype=torch.bfloat16):
        name = type(self).__name__
        self._muon_defaults = _muon_defaults(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
                                             adjust_lr_fn, ns_dtype)
        self._adam_defaults = dict(lr=adam_lr, betas=tuple(adam_betas), eps=adam_eps, weight_decay=adam_weight_decay)
        check_muon_group(name, {**self._muon_defaults, "params": []})
        check_adam_group(name, self._adam_defaults)
        if isinstance(model_or_param_groups, torch.nn.Module):
            groups = self._groups_of(model_or_param_groups, per_head, muon, adam)
        else:
            if per_head or muon or adam:
                raise InvalidArgument(f"{name}: per_head=, muon= and adam= choose parameters of a model; with "
                                      "explicit param groups, mark each group use_muon=True/False instead")
            groups = list(model_or_param_groups)
            for i, g in enumerate(groups):
                if not isinstance(g, dict) or not isinstance(g.get("use_muon"), bool):
                    raise InvalidArgument(f"{name}: param group {i} needs 'use_muon': True or False (Muon for 2-D "
                                          "hidden matrices, Adam for the rest), or pass the model itself")
        super().__init__(groups, {})
        for group in self.param_groups:
            self._check(group)

    def _groups_of(self, model, per_head, muon, adam) -> list[dict]:
        from .muon_params import choose_muon_params

        choices = choose_muon_params(model, per_head=per_head, muon=muon, adam=adam)
        named = dict(model.named_parameters())
        mu = [n for n, c in choices.items() if c.muon]
        groups = []
        if mu:
            splits = [choices[n].head_split for n in mu]
            groups.append({"params": [named[n] for n in mu], "use_muon": True,
                           "head_splits": splits if any(s is not None for s in splits) else None})
        rest = [named[n] for n, c in choices.items() if not c.muon]
        if rest:
            groups.append({"params": rest, "use_muon": False})
        return groups

    def add_param_group(self, param_group: dict) -> None:
        use_muon = param_group.get("use_muon")
        if not isinstance(use_muon, bool):
            raise InvalidArgument(f"{type(self).__name__}: a param group needs 'use_muon': True or False")
        defaults = self._muon_defaults if use_muon else self._adam_defaults
        for k, v in defaults.items():
            param_group.setdefault(k, v)
        if use_muon:
            param_group.setdefault("head_splits", None)
        super().add_param_group(param_group)


__all__ = ["Muon", "MuonWithAuxAdam", "check_adam_group", "check_muon_group"]
