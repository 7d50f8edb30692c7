"""Replace each detected MoE block by an :class:`~.moe.AutoEPMoE` holding this rank's experts.

EP rank r keeps the contiguous block of experts ``[r*E/ep, (r+1)*E/ep)``, stacked as 3-D
parameters with the transformers-5 names (``<block>.<experts>.gate_up_proj`` and
``.down_proj``), so a consolidated checkpoint is the HF state dict. A ModuleList of
per-expert MLPs is converted to that fused layout. The local expert parameters get
``ParamLayout(replicas="expert_data", split=Split("expert", 0, ...))``; the router and the
shared experts keep the default layout (replicated over ``data``).
"""

from __future__ import annotations

import torch
from polyaccel.parallel import ParamLayout, Split, set_layout, set_plan

from .detect import FUSED_T, MODULE_LIST, EPPlan, MoELayerSpec
from .moe import AutoEPMoE, GroupedExperts


def _local_expert_tensors(spec: MoELayerSpec, experts, rows: range) -> tuple[torch.Tensor, torch.Tensor, bool]:
    if spec.layout == MODULE_LIST:
        g, d, u = spec.projections
        picked = [experts[e] for e in rows]
        gate_up = torch.stack([torch.cat([getattr(m, g).weight, getattr(m, u).weight], dim=0) for m in picked])
        down = torch.stack([getattr(m, d).weight for m in picked])
        req = getattr(picked[0], g).weight.requires_grad
        return gate_up.detach().clone(), down.detach().clone(), req
    gu, down = experts.gate_up_proj, experts.down_proj
    n = len(rows)
    return (gu.detach().narrow(0, rows.start, n).clone(), down.detach().narrow(0, rows.start, n).clone(),
            gu.requires_grad)


def expert_layout(spec: MoELayerSpec, ep: int, rank: int) -> ParamLayout:
    n = spec.num_experts // ep
    return ParamLayout(replicas="expert_data", split=Split(dim="expert", axis=0, sections=((n,) * ep,), rank=rank))


def convert(model: torch.nn.Module, plan: EPPlan, *, group=None, ep_rank: int = 0) -> torch.nn.Module:
    """Swap every block of ``plan`` in place; returns ``model`` (records the plan as ``model.autoep_plan``;
    transformers 5 owns ``ep_plan`` on its models)."""
    ep = plan.ep_size
    for spec in plan.layers:
        block = model.get_submodule(spec.name)
        kids = dict(block.named_children())
        rows = spec.experts_of(ep, ep_rank)
        gate_up, down, req = _local_expert_tensors(spec, kids[spec.experts_name], rows)
        experts = GroupedExperts(gate_up, down, transposed=spec.layout == FUSED_T, first_expert=rows.start,
                                 num_experts=spec.num_experts, requires_grad=req)
        layout = expert_layout(spec, ep, ep_rank)
        set_layout(experts.gate_up_proj, layout)
        set_layout(experts.down_proj, layout)
        new = AutoEPMoE(spec, kids[spec.router_name], experts,
                        kids.get(spec.shared_name) if spec.shared_name else None,
                        kids.get(spec.shared_gate_name) if spec.shared_gate_name else None,
                        group=group, ep_size=ep, ep_rank=ep_rank)
        new.capture_graphs = plan.capture_graphs
        new.train(block.training)
        parent_name, _, child = spec.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    model.autoep_plan = plan
    set_plan(model, "expert", plan)
    return model
