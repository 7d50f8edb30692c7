"""AutoEP: expert parallelism for Hugging Face MoE models, found from the module structure.

``polyaccel.initialize(model, {"expert_parallel": {"autoep_size": N}, "zero_optimization": ...})``
(or :func:`apply_autoep` directly) finds the MoE blocks (Mixtral, Qwen2/Qwen3-MoE, OLMoE,
DeepSeek-V3, GLM-4-MoE and anything with the same structure plus explicit routing knobs),
places experts ``[r*E/ep, (r+1)*E/ep)`` on EP rank r, dispatches tokens with a dropless
all-to-all, runs the local experts on the op registry's ``grouped_mm`` and ``swiglu``, and
combines with the router weights. ``model.autoep_plan`` (:func:`ep_plan`; and ``polyaccel autoep-plan``) prints
layer -> experts per rank -> routing. See ``docs/autoep.md``.
"""

from __future__ import annotations

from .config import AutoEPConfig, parse_config
from .detect import EPPlan, LayoutError, MoELayerSpec, detect
from .moe import AutoEPMoE, GroupedExperts, route
from .presets import PRESETS, Routing


def apply_autoep(model, section: dict | None = None, mesh=None):
    """Apply AutoEP to ``model``; without ``mesh`` the expert degree must be 1 (no process group needed)."""
    from .convert import convert
    from .layer import apply

    if mesh is not None:
        return apply(model, section or {}, mesh)
    cfg = parse_config(section)
    if cfg.autoep_size != 1:
        from polyaccel.errors import ConfigError

        raise ConfigError(f"autoep_size={cfg.autoep_size} needs a mesh (polyaccel.comm.mesh.init_parallel_mesh)")
    if not cfg.enabled:
        return model
    return convert(model, detect(model, cfg, 1), group=None, ep_rank=0)


def ep_plan(obj) -> EPPlan | None:
    """The plan AutoEP applied to a model (or to an engine's ``module``), else None."""
    module = getattr(obj, "module", obj)
    return getattr(module, "autoep_plan", None)


__all__ = ["PRESETS", "AutoEPConfig", "AutoEPMoE", "EPPlan", "GroupedExperts", "LayoutError", "MoELayerSpec",
           "Routing", "apply_autoep", "detect", "ep_plan", "parse_config", "route"]
