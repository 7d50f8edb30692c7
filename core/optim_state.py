"""Optimizer state dtypes: float32 states for 16-bit parameters, kept float32 across ``load_state_dict``.

``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor to its parameter's
dtype (all but ``step``), which would round a bf16 parameter's float32 moments to bf16 on every
resume. :func:`load_state_dict_keeping_dtypes` loads through torch and then puts the saved
values back in the dtype the optimizer allocates them in (:func:`state_dtype`).
"""

from __future__ import annotations

import torch


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """float32 for 16-bit parameters, the parameter's own dtype otherwise."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


def load_state_dict_keeping_dtypes(optimizer: torch.optim.Optimizer, load, state_dict: dict) -> None:
    """``load(state_dict)`` (torch's ``load_state_dict``), then each floating state in :func:`state_dtype`."""
    saved = state_dict["state"]
    load(state_dict)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for idx, st in saved.items():
        p = params[idx]
        if not p.is_floating_point():
            continue
        for key, value in st.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                optimizer.state[p][key] = value.to(device=p.device, dtype=state_dtype(p), copy=True)
