"""The router logits of a MoE block, without the router's own top-k where nothing can tell the difference.

AutoEP keeps the block's router module, so what observes it (transformers' output recorders, hooks
of a framework) still sees it called. transformers' routers (Mixtral's, Qwen's, OLMoE's) return
``(logits, scores, indices)``: after the logits they take their own softmax, top-k and
renormalisation, six kernels a forward whose results AutoEP's :func:`~.moe.route` discards (it
picks the experts itself, by the family's rule). A step with few tokens a layer is bound by the
host's launches, so where the router is one of those classes, unsubclassed, and nothing hooks it,
its logits are computed as its forward computes them (``F.linear(x, weight)``), and nothing else.
Any hook on the router (a recorder asked for ``router_logits``, ZeRO stage 3's parameter gathers)
or a global module hook, and the router module is called as before.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as _module

#: transformers router classes whose forward's first output is ``F.linear(hidden.reshape(-1, H), self.weight)``
LINEAR_ROUTERS = frozenset({"MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter",
                            "Qwen3NextTopKRouter"})


def is_linear_router(router: torch.nn.Module) -> bool:
    """Whether ``router``'s logits are ``F.linear(x, weight[, bias])`` of its input rows by its class: one of
    transformers' :data:`LINEAR_ROUTERS` (not a subclass) or a plain ``nn.Linear``."""
    cls = type(router)
    if cls is torch.nn.Linear:
        return True
    return cls.__name__ in LINEAR_ROUTERS and cls.__module__.startswith("transformers.models.")


def _hooked(router: torch.nn.Module) -> bool:
    """Whether calling the module would run anything besides its forward (its own hooks or global ones)."""
    return bool(router._forward_hooks or router._forward_pre_hooks or router._backward_hooks
                or router._backward_pre_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks or _module._global_backward_hooks
                or _module._global_backward_pre_hooks)


def router_logits(router: torch.nn.Module, x: torch.Tensor, linear: bool = True) -> torch.Tensor:
    """The logits [T, E] of ``router`` for rows ``x`` [T, H]. The router module is called unless its logits can be
    computed alone (module docstring; asked at every call: a wrapper may change the module's class or hook it
    later); ``linear=False`` always calls it."""
    if linear and is_linear_router(router) and not _hooked(router):
        # (an nn.Linear's bias is a parameter or None; transformers' routers' forward passes none)
        bias = router.bias if type(router) is torch.nn.Linear else None
        return torch.nn.functional.linear(x, router.weight, bias)
    out = router(x)
    return out[0] if isinstance(out, tuple) else out
