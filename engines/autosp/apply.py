"""Apply AutoSP to a Hugging Face model: checks first, then the attention implementation and one hook.

Nothing changes before every check has passed (attention modules, implementation, layer kinds,
heads over tensor and sequence ranks). Then:

- the wrapped implementation (:mod:`.attention`) is registered and set on every config the
  attention modules read; each attention module gets the shared :class:`~.attention.SPState`;
- a forward pre-hook on the decoder (``model.base_model``) takes the whole 2-D ``attention_mask``
  away from the model (the model then builds no mask for its shard), checks it covers ``S`` times
  the local tokens, gathers the global ``position_ids`` over the sequence group (absent: this rank's
  ``rank * seq/S + arange``, given to the model so rotary embeddings use global positions), and
  turns the KV cache off (``use_cache=False``; a given cache is refused: this is training).

At ``autosp_size`` 1 nothing is applied: the model is returned as it is.
"""

from __future__ import annotations

import inspect

import torch
from polyaccel import comm
from polyaccel.errors import ConfigError, InvalidArgument

from .attention import STATE_ATTR, BatchView, SPState, register
from .config import parse
from .detect import WRAPPED, SPPlan, check_heads, check_layer_kinds, find_attention, implementation_of, local_heads

PLAN_ATTR = "autosp_plan"


def plan_sequence_parallel(model, section, tensor: int = 1) -> SPPlan:
    """Every check, no change: the plan for ``model`` at this section's size and ``tensor`` ranks."""
    cfg = parse(section)
    config = getattr(model, "config", None)
    if config is None:
        raise ConfigError(f"sequence_parallel needs a Hugging Face model (with .config), got {type(model).__name__}")
    attention = find_attention(model)
    implementation = implementation_of(attention)
    check_layer_kinds(config)
    reps = 1
    shapes = local_heads(model, config, tensor)
    for q_heads, kv_heads in shapes:
        reps = max(reps, check_heads(q_heads, kv_heads, cfg.autosp_size))
    q0, kv0 = shapes[0]
    return SPPlan(size=cfg.autosp_size, implementation=implementation, attention=attention, q_heads=max(q0),
                  kv_heads=max(kv0), kv_replication=reps)


def apply_sequence_parallel(model, section, mesh):
    cfg = parse(section)
    size = mesh.size("sequence")
    if size != cfg.autosp_size:
        raise ConfigError(f"sequence_parallel.autosp_size is {cfg.autosp_size} but the mesh's sequence dimension "
                          f"is {size}")
    if size == 1:
        return model
    plan = plan_sequence_parallel(model, cfg, mesh.size("tensor"))
    register()
    state = SPState(mesh.group("sequence"), size, mesh.rank("sequence"), model.config)
    configs = {id(model.config): model.config}
    for module in plan.attention.values():
        object.__setattr__(module, STATE_ATTR, state)
        c = getattr(module, "config", None)
        if c is not None:
            configs.setdefault(id(c), c)
    name = WRAPPED[plan.implementation]
    for c in configs.values():
        c._attn_implementation = name
    decoder = getattr(model, "base_model", model)
    decoder.register_forward_pre_hook(_Prepare(state, decoder), with_kwargs=True)
    model.__dict__[PLAN_ATTR] = plan
    return model


class _Prepare:
    """The decoder's forward pre-hook (see the module docstring)."""

    def __init__(self, state: SPState, decoder):
        self.state = state
        self.signature = inspect.signature(decoder.forward)

    def __call__(self, module, args, kwargs):
        bound = self.signature.bind_partial(*args, **kwargs)
        a = bound.arguments
        extra = a.pop(next((k for k, p in self.signature.parameters.items() if p.kind is p.VAR_KEYWORD), ""), {})
        a.update(extra)
        state = self.state
        ids = a.get("input_ids")
        tokens = ids if ids is not None else a.get("inputs_embeds")
        if tokens is None:
            raise InvalidArgument("sequence_parallel: the model got neither input_ids nor inputs_embeds")
        if a.get("past_key_values") is not None or a.get("cache") is not None:
            raise InvalidArgument("sequence_parallel is for training: a KV cache (cache / past_key_values) cannot be "
                                  "split over sequence ranks; remove it")
        if a.get("output_attentions"):
            raise InvalidArgument("sequence_parallel: output_attentions is not available (each rank attends with "
                                  "a part of the heads); remove it")
        rows, local = tokens.shape[0], tokens.shape[1]
        length = local * state.size
        mask = a.get("attention_mask")
        if mask is not None:
            if not torch.is_tensor(mask) or mask.dim() != 2 or tuple(mask.shape) != (rows, length):
                shape = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
                raise InvalidArgument(
                    f"sequence_parallel: attention_mask must be the whole sequence's 2-D [batch, seq] padding mask "
                    f"({rows} x {length} for {local} local tokens x {state.size} ranks), got {shape}; "
                    "polyaccel.sequence.split_batch keeps it whole")
        pos = a.get("position_ids")
        if pos is None:
            local_pos = torch.arange(state.rank * local, (state.rank + 1) * local, device=tokens.device)[None]
            full_pos = torch.arange(length, device=tokens.device)[None]
        else:
            if pos.dim() != 2 or pos.shape[1] != local:
                raise InvalidArgument(f"sequence_parallel: position_ids of shape {tuple(pos.shape)}, expected "
                                      f"[batch, {local}] (this rank's tokens, global positions)")
            local_pos = pos
            full_pos = _gather_positions(pos, state)
        state.batch = BatchView(rows, length, mask, full_pos)
        a["attention_mask"] = None
        a["position_ids"] = local_pos
        if "use_cache" in self.signature.parameters or extra:
            a["use_cache"] = False
        return (), a


def _gather_positions(pos: torch.Tensor, state: SPState) -> torch.Tensor:
    """This rank's ``[rows, L/S]`` global positions -> the whole ``[rows, L]``."""
    send = pos.contiguous().reshape(1, -1)
    out = torch.empty(state.size, send.shape[1], dtype=pos.dtype, device=pos.device)
    comm.all_gather_into_tensor(out, send, group=state.group)
    rows, local = pos.shape
    return out.view(state.size, rows, local).permute(1, 0, 2).reshape(rows, state.size * local)
