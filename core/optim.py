"""``torch.optim.Optimizer`` front-ends for the fused optimizer ops.

Each ``step()`` groups parameters by (device type, step count) and calls the op
registry once per group, so a 200-tensor model is one op call per device type.
State is kept per parameter (``step``, ``exp_avg`` [, ``exp_avg_sq``]) in fp32 for
16-bit parameters, and round-trips through ``state_dict()``.

``capturable=True`` (Adam, Lamb) keeps each step count as a tensor on the parameter's device
and hands the op that tensor, never a host number: ``step()`` then runs without a host sync
and can be captured in a device graph (the replayed graph advances the count and the bias
correction). The op receives the step tensor of the first parameter of each device batch:
in a capturable run every parameter with a gradient is stepped together.

Hyperparameters follow the op contract's rules (finite ``lr >= 0``, ``weight_decay >= 0`` and
``eps > 0``, betas in ``[0, 1)``, ``0 < min_coeff <= max_coeff``): checked at construction and
again at each ``step()``, for every group, before any state or parameter changes.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from . import ops
from .errors import InvalidArgument, OpError
from .ops import contract
from .optim_state import load_state_dict_keeping_dtypes


def _state_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


class _FusedOptimizer(torch.optim.Optimizer):
    _state_names: tuple[str, ...] = ()

    def _check_hyperparameters(self, group) -> None:
        """The op contract's rules (:mod:`polyaccel.ops.contract`) for one param group's values.

        Run at construction and at the start of every ``step()`` (values edited in
        ``param_groups`` later are checked too) before any state or parameter is touched.
        """
        name = type(self).__name__
        contract.check_lr(name, group["lr"])
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise InvalidArgument(f"{name}: betas={betas!r} is not allowed; betas must be two values in [0, 1)")
        contract.check_beta(name, betas[0], "betas[0]")
        contract.check_beta(name, betas[1], "betas[1]")
        contract.check_weight_decay(name, group["weight_decay"])
        if "eps" in group:
            contract.check_eps(name, group["eps"])
        if "min_coeff" in group:
            contract.check_trust_bounds(name, group["min_coeff"], group["max_coeff"])

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, keeping float32 states of 16-bit parameters float32 (torch would cast them to bf16)."""
        load_state_dict_keeping_dtypes(self, super().load_state_dict, state_dict)

    def _init_state(self, p: torch.Tensor, capturable: bool) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if capturable else "cpu")
            for name in self._state_names:
                st[name] = torch.zeros_like(p, dtype=_state_dtype(p), memory_format=torch.preserve_format)
        return st

    def _groups(self, group):
        """Yield (step, params, grads, *state lists) batches for one param group."""
        batches = defaultdict(lambda: [[] for _ in range(2 + len(self._state_names))])
        steps: dict = {}  # capturable: device -> the step tensor handed to the op
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise OpError(f"{type(self).__name__} does not support sparse gradients")
            capturable = group.get("capturable", False)
            st = self._init_state(p, capturable)
            if capturable and st["step"].device != p.device:
                st["step"] = st["step"].to(p.device)  # e.g. a state_dict loaded with host steps
            st["step"] += 1
            if p.numel() == 0:
                continue
            key = (p.device, None) if capturable else (p.device, int(st["step"].item()))
            if key not in batches and capturable:
                steps[key] = st["step"]
            lists = batches[key]
            lists[0].append(p)
            lists[1].append(p.grad)
            for i, name in enumerate(self._state_names):
                lists[2 + i].append(st[name])
        for key, lists in batches.items():
            yield steps.get(key, key[1]), lists

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._check_hyperparameters(group)
        for group in self.param_groups:
            for step, lists in self._groups(group):
                self._apply(group, step, lists)
        return loss

    def _apply(self, group, step, lists):  # pragma: no cover - abstract
        raise NotImplementedError


class FusedAdam(_FusedOptimizer):
    """Adam / AdamW (``adam_w_mode=True``, the default) through the ``fused_adam`` op."""

    _state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adam_w_mode=True, bias_correction=True, capturable=False):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                        bias_correction=bias_correction, capturable=capturable)
        self._check_hyperparameters(defaults)
        super().__init__(params, defaults)

    def _apply(self, group, step, lists):
        b1, b2 = group["betas"]
        ops.fused_adam(*lists, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                       weight_decay=group["weight_decay"], step=step, adam_w_mode=group["adam_w_mode"],
                       bias_correction=group["bias_correction"])


class FusedLion(_FusedOptimizer):
    """Lion (sign of an interpolated momentum) through the ``fused_lion`` op."""

    _state_names = ("exp_avg",)

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        self._check_hyperparameters(defaults)
        super().__init__(params, defaults)

    def _apply(self, group, step, lists):
        b1, b2 = group["betas"]
        ops.fused_lion(*lists, lr=group["lr"], beta1=b1, beta2=b2, weight_decay=group["weight_decay"])


class FusedLamb(_FusedOptimizer):
    """LAMB (per-tensor trust ratio on the Adam direction) through the ``fused_lamb`` op."""

    _state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 bias_correction=True, max_coeff=10.0, min_coeff=0.01, capturable=False):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff,
                        capturable=capturable)
        self._check_hyperparameters(defaults)
        super().__init__(params, defaults)

    def _apply(self, group, step, lists):
        b1, b2 = group["betas"]
        ops.fused_lamb(*lists, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                       weight_decay=group["weight_decay"], step=step,
                       bias_correction=group["bias_correction"], max_coeff=group["max_coeff"],
                       min_coeff=group["min_coeff"])


from .optim_muon import Muon, MuonWithAuxAdam  # noqa: E402 -- the Muon front-ends, re-exported

__all__ = ["FusedAdam", "FusedLamb", "FusedLion", "Muon", "MuonWithAuxAdam"]
