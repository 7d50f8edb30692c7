"""``optimizer.type: "muon"``: the Muon settings of the config's ``optimizer.params``, validated.

Muon steps the 2-D weight matrices (momentum, then Newton-Schulz orthogonalization of the
update); every other trainable parameter (embeddings, the output head, norms, biases) is stepped
by an auxiliary AdamW with its own ``adam_*`` settings. Which parameter goes where is
:func:`polyaccel.engines.zero.muon.choose_params`' decision (``muon_params`` / ``adam_params``
name patterns override it). ``lr`` and ``weight_decay`` are Muon's.

Keys (defaults): ``lr`` (0.02), ``weight_decay`` (0), ``momentum`` (0.95), ``nesterov`` (true),
``ns_steps`` (5), ``ns_coefficients`` (torch.optim.Muon's quintic), ``eps`` (1e-7),
``lr_adjustment`` ("original" | "match_rms_adamw" | "none"), ``ns_dtype`` ("bf16" | "fp16" | "fp32" |
"fp64"), ``per_head`` (false), ``muon_params`` / ``adam_params`` (lists of name patterns),
``adam_lr`` (3e-4), ``adam_betas`` ([0.9, 0.95]), ``adam_eps`` (1e-10), ``adam_weight_decay`` (0),
``gather_bucket_size`` (elements of one round's gather buffer, all ranks' chunks together; default
the ``reduce_bucket_size``), ``tensor_parallel`` ("gather": a matrix split over tensor ranks is
assembled before its orthogonalization; "shard": each rank orthogonalizes its own piece).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from polyaccel.errors import ConfigError
from polyaccel.ops.reference.muon import LR_ADJUSTMENTS, NS_COEFFICIENTS, NS_EPS, NS_STEPS

MUON_PARAM_KEYS = frozenset({
    "momentum", "nesterov", "ns_steps", "ns_coefficients", "eps", "lr_adjustment", "ns_dtype", "per_head",
    "muon_params", "adam_params", "adam_lr", "adam_betas", "adam_eps", "adam_weight_decay",
    "gather_bucket_size", "tensor_parallel",
})
NS_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32, "fp64": torch.float64, "float64": torch.float64}
TENSOR_PARALLEL_MODES = ("gather", "shard")


@dataclass(frozen=True)
class MuonConfig:
    """The Muon-specific part of ``optimizer.params`` (``lr`` and ``weight_decay`` live on the optimizer)."""

    DEFAULT_LR = 0.02

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = NS_STEPS
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    eps: float = NS_EPS
    lr_adjustment: str = "original"
    ns_dtype: torch.dtype = torch.bfloat16
    per_head: bool = False
    muon_params: tuple[str, ...] = ()
    adam_params: tuple[str, ...] = ()
    adam_lr: float = 3e-4
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-10
    adam_weight_decay: float = 0.0
    #: None: the ``zero_optimization.reduce_bucket_size``
    gather_bucket_size: int | None = None
    tensor_parallel: str = "gather"


def _key(k: str) -> str:
    return f"optimizer.params.{k}"


def _number(k: str, v: Any, lo: float, hi: float | None = None, lo_open: bool = False, hi_open: bool = True):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if lo_open else v >= lo) and (hi is None or (v < hi if hi_open else v <= hi))
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}{')' if hi_open else ']'}"
        raise ConfigError(f"config key {_key(k)!r} must be a finite number in {rng}, got {v!r}")
    return float(v)


def _patterns(k: str, v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
        raise ConfigError(f"config key {_key(k)!r} must be a list of parameter-name patterns (fnmatch strings, "
                          f"e.g. ['*.mlp.*']), got {v!r}")
    return tuple(v)


def _choice(k: str, v: Any, allowed) -> str:
    if not isinstance(v, str) or v.lower() not in allowed:
        raise ConfigError(f"config key {_key(k)!r} must be one of {', '.join(allowed)}, got {v!r}")
    return v.lower()


def parse_muon(params: dict) -> MuonConfig:
    """The :class:`MuonConfig` of a validated ``optimizer.params`` dict (only read)."""
    out: dict[str, Any] = {}
    if "momentum" in params:
        out["momentum"] = _number("momentum", params["momentum"], 0.0, 1.0)
    for k in ("nesterov", "per_head"):
        if k in params:
            if not isinstance(params[k], bool):
                raise ConfigError(f"config key {_key(k)!r} must be true or false, got {params[k]!r}")
            out[k] = params[k]
    if "ns_steps" in params:
        v = params["ns_steps"]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 100:
            raise ConfigError(f"config key {_key('ns_steps')!r} must be an integer in [0, 100), got {v!r}")
        out["ns_steps"] = v
    if "ns_coefficients" in params:
        v = params["ns_coefficients"]
        if (not isinstance(v, (list, tuple)) or len(v) != 3
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)):
            raise ConfigError(f"config key {_key('ns_coefficients')!r} must be three finite numbers (a, b, c), "
                              f"got {v!r}")
        out["ns_coefficients"] = tuple(float(x) for x in v)
    if "eps" in params:
        out["eps"] = _number("eps", params["eps"], 0.0, None, lo_open=True)
    if "lr_adjustment" in params:
        out["lr_adjustment"] = _choice("lr_adjustment", params["lr_adjustment"], LR_ADJUSTMENTS)
    if "ns_dtype" in params:
        out["ns_dtype"] = NS_DTYPES[_choice("ns_dtype", params["ns_dtype"], tuple(NS_DTYPES))]
    for k in ("muon_params", "adam_params"):
        if k in params:
            out[k] = _patterns(k, params[k])
    if "adam_lr" in params:
        out["adam_lr"] = _number("adam_lr", params["adam_lr"], 0.0, None)
    if "adam_betas" in params:
        b = params["adam_betas"]
        if (not isinstance(b, (list, tuple)) or len(b) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1 for x in b)):
            raise ConfigError(f"config key {_key('adam_betas')!r} must be two numbers in [0, 1), got {b!r}")
        out["adam_betas"] = (float(b[0]), float(b[1]))
    if "adam_eps" in params:
        out["adam_eps"] = _number("adam_eps", params["adam_eps"], 0.0, None)
    if "adam_weight_decay" in params:
        out["adam_weight_decay"] = _number("adam_weight_decay", params["adam_weight_decay"], 0.0, None)
    if "gather_bucket_size" in params:
        v = params["gather_bucket_size"]
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"config key {_key('gather_bucket_size')!r} must be an integer >= 1 (elements), "
                              f"got {v!r}")
        out["gather_bucket_size"] = v
    if "tensor_parallel" in params:
        out["tensor_parallel"] = _choice("tensor_parallel", params["tensor_parallel"], TENSOR_PARALLEL_MODES)
    return MuonConfig(**out)
