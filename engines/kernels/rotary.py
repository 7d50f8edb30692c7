"""The rotary application inside Hugging Face attention, run through ``polyaccel.ops.rope``.

Hugging Face's attention modules rotate q and k by calling the module-level function
``apply_rotary_pos_emb`` of their modeling file from inside ``forward``; nothing in the model holds it,
so there is no module to replace. The hook used here, without editing any file:

1. The function is recognised by what it computes: run on random q, k, cos, sin (float64), it must equal
   ``x * cos + rotate(x) * sin`` in the split-half (``rotate_half``) or the interleaved form; Phi-3's
   partial rotation (only the first ``cos.shape[-1]`` features rotated) is probed too.
2. The modeling module's global is replaced once by a dispatcher that keeps the original function and
   calls it, unchanged, for every caller, except while a swapped attention's ``forward`` runs in this
   thread: then the call goes to the op (the shapes it cannot take still go to the original). Models of
   the same family without kernels in the same process keep Hugging Face's code.
3. Each recognised attention module gets an instance ``forward`` that marks that window around its own
   forward (class, parameters and hooks unchanged). The window opens again when activation checkpointing
   reruns the forward in backward, so the recomputation runs the same kernel as the forward did.

Why not a replacement attention forward: the attention forwards differ per family (Qwen3's q/k norms,
Gemma2's logit softcapping and sliding windows, Phi-3's fused qkv, AutoTP's local head counts) and a copy
of each would drift from the installed transformers; the rotation is the one piece they share, behind
one name. Why not a patch held only for the model's forward: activation checkpointing recomputes
outside it.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading

import torch
from torch import nn

from .norm import KERNEL_ATTR, call_original

NAME = "apply_rotary_pos_emb"
ORIGINAL_ATTR = "_polyaccel_rotary_original"


class _Window(threading.local):
    depth = 0  # swapped attention forwards running in this thread


_WINDOW = _Window()


def forward_names(cls: type) -> tuple[str, ...]:
    """The global names the class's (undecorated) ``forward`` reads."""
    fn = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(fn, "__code__", None)
    return tuple(code.co_names) if code is not None else ()


def calls_rotary(module: nn.Module) -> bool:
    return NAME in forward_names(type(module))


def namespace_of(module: nn.Module):
    return sys.modules.get(type(module).__module__)


def original_of(namespace) -> object | None:
    fn = getattr(namespace, NAME, None)
    return getattr(fn, ORIGINAL_ATTR, fn)


def _rotate(x, interleaved):
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _expected(x, cos, sin, interleaved):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    r = c.shape[-1]
    rotated = x[..., :r] * c + _rotate(x[..., :r], interleaved) * s
    return torch.cat([rotated, x[..., r:]], dim=-1)


def probe(fn) -> tuple[dict | None, str]:
    """({"interleaved": bool, "partial": bool}, "") when ``fn`` is a rotary application, else (None, why)."""
    if not callable(fn):
        return None, f"its modeling file has no callable {NAME}"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 1, 4, 8, generator=g, dtype=torch.float64)

    def matches(width):
        cos = torch.randn(2, 4, width, generator=g, dtype=torch.float64)
        sin = torch.randn(2, 4, width, generator=g, dtype=torch.float64)
        try:
            with torch.no_grad():
                qo, ko = fn(q, k, cos, sin)
        except Exception:  # noqa: BLE001 - a form it cannot run is a form it does not have
            return None
        for interleaved in (False, True):
            if all(isinstance(o, torch.Tensor) and o.shape == x.shape
                   and torch.allclose(o, _expected(x, cos, sin, interleaved), rtol=1e-12, atol=1e-12)
                   for o, x in ((qo, q), (ko, k))):
                return interleaved
        return None

    full = matches(8)
    if full is None:
        return None, f"{NAME} is not x * cos + rotate(x) * sin (probed, split-half and interleaved)"
    return {"interleaved": full, "partial": matches(4) is full}, ""


def _rope(q, k, cos, sin, interleaved):
    from polyaccel import ops

    return ops.rope(q, k, cos, sin, interleaved=interleaved)


def dispatch(original, form: dict, q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
    """What the modeling file's ``apply_rotary_pos_emb`` becomes: the op inside a swapped attention's forward
    for the shapes the op takes, else the original function."""
    if (not _WINDOW.depth or args or kwargs or unsqueeze_dim not in (1, 2) or not _takes(q, k, cos, sin, form)):
        return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
    if unsqueeze_dim == 2:  # [B, S, H, D]: the op's layout is [B, H, S, D]
        qo, ko = dispatch(original, form, q.transpose(1, 2), k.transpose(1, 2), cos, sin, 1)
        return qo.transpose(1, 2), ko.transpose(1, 2)
    width = cos.shape[-1]
    if width == q.shape[-1]:
        return _rope(q, k, cos, sin, form["interleaved"])
    qr, kr = _rope(q[..., :width], k[..., :width], cos, sin, form["interleaved"])
    return torch.cat([qr, q[..., width:]], dim=-1), torch.cat([kr, k[..., width:]], dim=-1)


def _takes(q, k, cos, sin, form) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)) or q.dim() != 4 or k.dim() != 4:
        return False
    if q.dtype != k.dtype or cos.dtype != sin.dtype or cos.shape != sin.shape or cos.dim() not in (2, 3):
        return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return False
    width = cos.shape[-1]
    return width % 2 == 0 and (width == q.shape[-1] or (form["partial"] and 0 < width < q.shape[-1]))


def install(namespace, original, form: dict) -> None:
    """Put the dispatcher in place of ``namespace``'s function (once; it calls ``original`` outside the window)."""
    current = getattr(namespace, NAME)
    if getattr(current, ORIGINAL_ATTR, None) is not None:
        return
    fn = functools.wraps(original)(functools.partial(dispatch, original, form))
    setattr(fn, ORIGINAL_ATTR, original)
    setattr(namespace, NAME, fn)


def attention_forward(module: nn.Module, original, *args, **kwargs):
    _WINDOW.depth += 1
    try:
        return call_original(module, original, *args, **kwargs)
    finally:
        _WINDOW.depth -= 1


def swap(module: nn.Module) -> None:
    original = module.__dict__.get("forward")
    module.forward = functools.partial(attention_forward, module, original)
    setattr(module, KERNEL_ATTR, "rope")


__all__ = ["NAME", "calls_rotary", "dispatch", "install", "namespace_of", "original_of", "probe", "swap"]
