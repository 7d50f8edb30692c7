"""What AutoSP needs to know of a model before it changes anything, and what it refuses.

Ulysses attention is hooked where Hugging Face picks the attention function (the attention
interface and ``config._attn_implementation``), so any module whose ``forward`` calls through
``ALL_ATTENTION_FUNCTIONS`` works unchanged. A module that looks like attention (its class name
ends in ``Attention``, or a ``torch.nn.MultiheadAttention``) but computes it some other way, with
no such module inside it, is refused with its class named: its sequence would be attended in parts.
"""

from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass, field

import torch.nn as nn
from polyaccel.errors import ConfigError
from polyaccel.parallel import get_plan

#: wrapped implementation -> the name the layer registers for it
WRAPPED = {"sdpa": "polyaccel_ulysses_sdpa", "eager": "polyaccel_ulysses_eager"}
LAYER_KINDS = ("full_attention", "sliding_attention")


@dataclass
class SPPlan:
    size: int
    implementation: str  # the wrapped one: "sdpa" or "eager"
    attention: dict[str, nn.Module] = field(default_factory=dict)
    q_heads: int = 0  # per tensor rank, before the sequence split
    kv_heads: int = 0
    kv_replication: int = 1  # each KV head copied this many times so every sequence rank gets whole heads

    def describe(self) -> str:
        kv = (f"; KV heads copied x{self.kv_replication} ({self.kv_heads} -> {self.kv_heads * self.kv_replication})"
              if self.kv_replication > 1 else "")
        return (f"AutoSP: sequence {self.size}, Ulysses over {len(self.attention)} attention modules "
                f"({self.implementation}); {self.q_heads} query heads -> {self.q_heads // self.size} per rank{kv}")


def uses_attention_interface(module: nn.Module) -> bool:
    fwd = inspect.unwrap(type(module).forward)
    code = getattr(fwd, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def _looks_like_attention(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or type(module).__name__.endswith("Attention")


def find_attention(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the attention modules that call the interface; refuses the others."""
    known = {n: m for n, m in model.named_modules() if uses_attention_interface(m)}
    unknown = [(n, m) for n, m in model.named_modules() if _looks_like_attention(m) and n not in known
               and not any(k.startswith(n + ".") or n == "" for k in known)]
    if unknown:
        listed = ", ".join(f"{n or '<root>'} ({type(m).__module__}.{type(m).__name__})" for n, m in unknown[:4])
        raise ConfigError(
            f"sequence_parallel: {len(unknown)} attention module(s) do not call Hugging Face's attention interface "
            f"(ALL_ATTENTION_FUNCTIONS), so Ulysses attention cannot be put in them: {listed}. AutoSP supports "
            "models whose attention dispatches on config._attn_implementation")
    if not known:
        raise ConfigError(f"sequence_parallel: {type(model).__name__} has no attention module that calls Hugging "
                          "Face's attention interface; AutoSP has nothing to split")
    return known


def implementation_of(attention: dict[str, nn.Module]) -> str:
    names = {getattr(getattr(m, "config", None), "_attn_implementation", None) for m in attention.values()}
    if len(names) != 1:
        raise ConfigError("sequence_parallel: the attention modules use different implementations "
                          f"{sorted(map(str, names))}")
    name = names.pop()
    if name in WRAPPED.values():
        raise ConfigError("sequence_parallel is already applied to this model (its attention implementation is "
                          f"{name!r})")
    if name not in WRAPPED:
        raise ConfigError(f"sequence_parallel wraps the attention implementations {list(WRAPPED)}; this model uses "
                          f"{name!r}. Load it with attn_implementation='sdpa' (or 'eager')")
    if name == "eager":
        for m in attention.values():
            if not callable(getattr(sys.modules[type(m).__module__], "eager_attention_forward", None)):
                raise ConfigError(f"sequence_parallel: {type(m).__name__}'s module {type(m).__module__} has no "
                                  "eager_attention_forward to wrap; use attn_implementation='sdpa'")
    return name


def check_layer_kinds(config) -> None:
    kinds = set(getattr(config, "layer_types", None) or ()) - set(LAYER_KINDS)
    if kinds:
        raise ConfigError(f"sequence_parallel builds masks for {list(LAYER_KINDS)} layers; this model also has "
                          f"{sorted(kinds)}")
    if getattr(config, "attention_chunk_size", None):
        raise ConfigError("sequence_parallel does not build chunked attention masks (config.attention_chunk_size "
                          f"{config.attention_chunk_size})")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_heads(q_heads, kv_heads, size: int) -> int:
    """Refuse query heads that do not split over ``size`` sequence ranks (per tensor rank, as AutoTP left
    them); returns how many times each KV head is copied so every sequence rank gets whole KV heads."""
    bad = [(r, q) for r, q in enumerate(q_heads) if q and q % size]
    if bad:
        nonzero = [q for q in q_heads if q]
        g = math.gcd(*nonzero)
        where = f"{bad[0][1]} query heads" + (f" on tensor rank {bad[0][0]} (of {len(q_heads)})"
                                               if len(q_heads) > 1 else "")
        raise ConfigError(f"sequence_parallel.autosp_size {size}: {where} do not split over {size} sequence ranks; "
                          f"sizes that divide the query heads: {_divisors(g)}")
    reps = 1
    for q, kv in zip(q_heads, kv_heads, strict=True):
        if q and kv and q % kv:
            raise ConfigError(f"{q} query heads are not a multiple of {kv} KV heads")
        if kv:
            reps = max(reps, math.lcm(kv, size) // kv)
    return reps


def local_heads(model: nn.Module, config, tensor: int) -> list[tuple[list[int], list[int]]]:
    """For each distinct attention shape: the query and KV heads each tensor rank holds (AutoTP's plan when
    it split the model, else all of them)."""
    tp_plan = get_plan(model, "tensor")
    if tp_plan is not None and getattr(tp_plan, "attention", None):
        return sorted({(tuple(a.q_heads), tuple(a.kv_heads)) for a in tp_plan.attention.values()})
    q = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or q
    if not isinstance(q, int):
        raise ConfigError(f"sequence_parallel: cannot read the number of attention heads from {type(config).__name__}")
    if tensor > 1:  # split by a layer that left no plan: an even split is assumed here, checked again at run time
        return [((q // tensor,) * tensor, (max(kv // tensor, 1),) * tensor)]
    return [((q,), (kv,))]
