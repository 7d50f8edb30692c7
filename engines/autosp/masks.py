"""The attention mask of the whole sequence, built once per forward for each kind of layer.

Attention runs over the whole sequence after the all-to-all, so the mask Hugging Face builds in
the model's forward (for a query shard of ``seq/S`` tokens) is of no use: the layer gives the model
no mask (its attention implementation has no mask function, so the model builds none) and builds
the whole one here with transformers' own mask builders, from the whole 2-D ``attention_mask`` and
the gathered global ``position_ids``, exactly as the unsplit model would: causal, padding, sliding
window, and packed sequences (positions that restart, with no 2-D mask: block-diagonal). The
builders see a config whose ``_attn_implementation`` is the wrapped one (``sdpa``: a boolean mask,
or none at all when it is plainly causal so SDPA's causal kernels run; ``eager``: an additive one).
"""

from __future__ import annotations

import torch


class MaskConfig:
    """A model config as the mask builders should see it: the wrapped implementation, this layer's window."""

    def __init__(self, base, implementation: str, sliding_window: int | None):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_attn_implementation", implementation)
        object.__setattr__(self, "sliding_window", sliding_window)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_base"), name)


def build_mask(config, implementation: str, sliding_window: int | None, *, batch: int, length: int,
               dtype: torch.dtype, device, attention_mask: torch.Tensor | None, position_ids: torch.Tensor):
    """The whole-sequence mask for one kind of layer (``None``: SDPA's causal flag suffices)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    cfg = MaskConfig(config, implementation, sliding_window)
    shape_only = torch.empty(batch, length, 0, dtype=dtype, device=device)
    build = create_causal_mask if sliding_window is None else create_sliding_window_causal_mask
    return build(config=cfg, inputs_embeds=shape_only, attention_mask=attention_mask, cache=None,
                 position_ids=position_ids)
