"""Ulysses attention as a Hugging Face attention implementation.

The layer sets ``config._attn_implementation`` to ``polyaccel_ulysses_sdpa`` (or ``_eager``), which
it registers in transformers' ``AttentionInterface``. Every attention module of every family that
dispatches through the interface then calls :func:`ulysses_attention` with its local q, k, v
(``[batch, heads, seq/S, dim]``, rotary already applied at global positions): one all-to-all turns
them into ``[batch, heads/S, seq, dim]``, the original function (transformers' ``sdpa``, or the
model file's own ``eager_attention_forward``) attends over the whole sequence with the
whole-sequence mask, and one all-to-all brings the output back to ``[batch, seq/S, heads, dim]``.

GQA: when a tensor rank's KV heads do not split over the S sequence ranks (fewer than S, or not a
multiple of it) each KV head is copied ``r = lcm(kv, S) / kv`` times before the exchange (as
``repeat_kv`` would, adjacent copies), so every rank gets whole KV heads for its whole query groups;
the copies' gradients are summed back by autograd. The attention function then sees
``num_key_value_groups = q / (kv * r)``.
"""

from __future__ import annotations

import math
import sys

import torch
from polyaccel.errors import ConfigError, InvalidArgument

from .all_to_all import heads_to_seq, seq_to_heads
from .detect import WRAPPED
from .masks import build_mask

STATE_ATTR = "_polyaccel_sp"


class _Groups:
    """The attention module as the wrapped function sees it, with this rank's query/KV group size."""

    def __init__(self, module, groups: int):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "num_key_value_groups", groups)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_module"), name)


def _original(implementation: str, module):
    if implementation == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    return sys.modules[type(module).__module__].eager_attention_forward


def ulysses_attention(implementation: str, module, query, key, value, attention_mask, **kwargs):
    state = module.__dict__.get(STATE_ATTR)
    if state is None:
        raise ConfigError(f"{type(module).__name__} runs with attention implementation {WRAPPED[implementation]!r} "
                          "but sequence_parallel was not applied to its model")
    batch = state.batch
    size, group = state.size, state.group
    b, hq, local, _ = query.shape
    if batch is None or local * size != batch.length or b != batch.rows:
        raise InvalidArgument(
            f"sequence_parallel: {type(module).__name__} got {local} tokens x {b} rows, but the model's forward "
            f"was prepared for {batch.length if batch else '?'} tokens over {size} ranks; call the model the layer "
            "was applied to, with this rank's part of the sequence (polyaccel.sequence.split_batch)")
    hk = key.shape[1]
    if hq % size:
        raise InvalidArgument(f"sequence_parallel: {hq} query heads do not split over {size} sequence ranks")
    reps = math.lcm(hk, size) // hk
    if reps > 1:
        key = key.repeat_interleave(reps, dim=1)
        value = value.repeat_interleave(reps, dim=1)
    q, k, v = seq_to_heads((query, key, value), group=group, size=size)
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    mask = state.mask(implementation, window, q.dtype, q.device)
    groups = hq // (hk * reps)
    target = module if getattr(module, "num_key_value_groups", groups) == groups else _Groups(module, groups)
    kwargs["position_ids"] = batch.position_ids
    out, _ = _original(implementation, module)(target, q, k, v, mask, **kwargs)
    return heads_to_seq(out, group=group, size=size), None


def register() -> None:
    """Register the wrapped implementations with transformers (idempotent). No mask function is registered
    for them, so the model builds no mask for its query shard; :mod:`.masks` builds the whole one."""
    from transformers import AttentionInterface

    for original, name in WRAPPED.items():
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _bind(original))


def _bind(implementation: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        return ulysses_attention(implementation, module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"polyaccel_ulysses_{implementation}"
    return attention


class BatchView:
    """What one forward's attention needs of the whole batch: rows, length, 2-D mask, global positions."""

    def __init__(self, rows: int, length: int, attention_mask, position_ids):
        self.rows, self.length = rows, length
        self.attention_mask, self.position_ids = attention_mask, position_ids
        self.masks: dict = {}


class SPState:
    """Shared by the attention modules of one model: the sequence group and the current forward's batch."""

    def __init__(self, group, size: int, rank: int, config):
        self.group, self.size, self.rank, self.config = group, size, rank, config
        self.batch: BatchView | None = None

    def mask(self, implementation: str, window, dtype: torch.dtype, device):
        """The whole-sequence mask for a layer with ``window`` (None: full causal), built once per forward."""
        b = self.batch
        key = (implementation, window, dtype)
        if key not in b.masks:
            b.masks[key] = build_mask(self.config, implementation, window, batch=b.rows, length=b.length,
                                      dtype=dtype, device=device, attention_mask=b.attention_mask,
                                      position_ids=b.position_ids)
        return b.masks[key]
