"""Swap the plugin kernels into a model: find the modules by what they compute, check, then swap.

Every module is classified before any is changed (:func:`plan_kernels`); then each recognised module
gets an instance ``forward`` that runs the op (:func:`apply_kernels`). Nothing else changes: no module
is replaced, so parameter names, state-dict keys, the parameters' layouts (AutoTP's splits, AutoEP's
placements) and every hook another layer or the engine put on a module stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyaccel.parallel import set_plan
from torch import nn

from . import loss, mlp, norm, rotary
from .config import parse, resolve_auto
from .plan import KernelPlan

PLAN_ATTR = "polyaccel_kernel_plan"


@dataclass
class _Swap:
    path: str
    module: nn.Module
    kernel: str
    what: str
    arg: object = None


def _device_type(model: nn.Module) -> str:
    for p in model.parameters():
        if p.device.type not in ("cpu", "meta"):
            return p.device.type
    import polyaccel

    return polyaccel.get_accelerator().device_type


class _Probes:
    """One probe per class (and per modeling file for the rotary function): the verdict is the class's."""

    def __init__(self):
        self.norms: dict = {}
        self.mlps: dict = {}
        self.rotary: dict = {}

    def norm(self, module):
        key = (type(module), norm.eps_attr(module), float(getattr(module, norm.eps_attr(module))))
        if key not in self.norms:
            self.norms[key] = norm.probe_offset(module)
        return self.norms[key]

    def mlp(self, module, shape):
        key = (type(module), shape, mlp.activation_name(module))
        if key not in self.mlps:
            self.mlps[key] = mlp.probe(module, shape)
        return self.mlps[key]

    def rope(self, namespace):
        if namespace not in self.rotary:
            self.rotary[namespace] = rotary.probe(rotary.original_of(namespace))
        return self.rotary[namespace]


def _looks_like(module: nn.Module) -> str | None:
    """The kernel a module's class name or members suggest it might be for (listed when not swapped)."""
    cls = type(module).__name__.lower()
    if "rmsnorm" in cls or norm.is_candidate(module):
        return "rms_norm"
    if cls.endswith("mlp") or mlp.shape_of(module):
        return "swiglu"
    if "attention" in cls or rotary.calls_rotary(module):
        return "rope"
    if "lm_head" in module._modules:
        return "cross_entropy"
    return None


def plan_kernels(model: nn.Module, on: dict[str, bool], why: dict[str, str]):
    """(plan, swaps): what each module would become; the model is not touched."""
    plan = KernelPlan(kernels=dict(on), why=dict(why))
    probes = _Probes()
    swaps: list[_Swap] = []
    for path, module in model.named_modules():
        kind = _looks_like(module)
        if kind is None:
            plan.untouched[type(module).__name__] += 1
            continue
        if getattr(module, norm.KERNEL_ATTR, None):
            plan.left[path] = f"already runs the {getattr(module, norm.KERNEL_ATTR)} kernel"
            continue
        if not on[kind]:
            plan.untouched[type(module).__name__] += 1
            continue
        swap, reason = _classify(path, module, kind, probes)
        if swap is None:
            plan.left[path] = reason
        else:
            swaps.append(swap)
    return plan, swaps


def _classify(path: str, module: nn.Module, kind: str, probes: _Probes) -> tuple[_Swap | None, str]:
    if kind == "rms_norm":
        if not norm.is_candidate(module):
            return None, "not a 1-parameter module with a 1-D weight and an epsilon (variance_epsilon / eps)"
        offset, why = probes.norm(module)
        if offset is None:
            return None, why
        return _Swap(path, module, kind, "rms_norm (1 + w)" if offset else "rms_norm", offset), ""
    if kind == "swiglu":
        shape = mlp.shape_of(module)
        if shape is None:
            return None, "no gate_proj/up_proj/down_proj (or gate_up_proj/down_proj) with an act_fn"
        why = probes.mlp(module, shape)
        if why:
            return None, why
        return _Swap(path, module, kind, "swiglu" if shape == mlp.SPLIT else "swiglu (fused gate_up_proj)", shape), ""
    if kind == "rope":
        if not rotary.calls_rotary(module):
            return None, f"its forward does not call {rotary.NAME}"
        namespace = rotary.namespace_of(module)
        form, why = probes.rope(namespace)
        if form is None:
            return None, why
        what = "rope" + (" (interleaved)" if form["interleaved"] else "") + (" (partial)" if form["partial"] else "")
        return _Swap(path, module, kind, what, (namespace, form)), ""
    why = loss.refusal(module)
    if why:
        return None, why
    return _Swap(path, module, kind, "cross_entropy"), ""


def apply_kernels(model: nn.Module, section, mesh=None) -> nn.Module:
    """Swap the kernels ``section`` turns on into ``model`` (in place); returns it. ``mesh``: the
    :class:`~polyaccel.comm.mesh.ParallelMesh` (its ``tensor`` group, when AutoTP split the lm_head)."""
    cfg = parse(section)
    from polyaccel import ops

    on, why = resolve_auto(cfg, _device_type(model), ops.registry)
    plan, swaps = plan_kernels(model, on, why)
    for s in swaps:
        if s.kernel == "cross_entropy":
            state = loss.swap(s.module, mesh)
            if state.group is not None:
                s.what = "cross_entropy (vocab-parallel over tensor)"
        elif s.kernel == "rms_norm":
            norm.swap(s.module, s.arg)
        elif s.kernel == "swiglu":
            mlp.swap(s.module, s.arg)
        else:
            namespace, form = s.arg
            rotary.install(namespace, rotary.original_of(namespace), form)
            if namespace.__name__ not in plan.rotary_modules:
                plan.rotary_modules.append(namespace.__name__)
            rotary.swap(s.module)
        plan.swapped[s.path] = s.what
    setattr(model, PLAN_ATTR, plan)
    set_plan(model, "kernels", plan)
    return model


def get_plan(model: nn.Module) -> KernelPlan | None:
    """The plan the kernels layer applied to ``model`` (also found through an engine's ``module``)."""
    return getattr(getattr(model, "module", model), PLAN_ATTR, None)


__all__ = ["PLAN_ATTR", "apply_kernels", "get_plan", "plan_kernels"]
