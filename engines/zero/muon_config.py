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

from dataclasses import dataclass

import torch
from polyaccel.config_check import Bool, Float, Floats, Int, OneOf, Section, Strings
from polyaccel.ops.reference.muon import LR_ADJUSTMENTS, NS_COEFFICIENTS, NS_EPS, NS_STEPS

MUON_PARAM_KEYS = frozenset({
    "momentum", "nesterov", "ns_steps", "ns_coefficients", "eps", "lr_adjustment", "ns_dtype", "per_head",
    "muon_params", "adam_params", "adam_lr", "adam_betas", "adam_eps", "adam_weight_decay",
    "gather_bucket_size", "tensor_parallel",
})
NS_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "fp64": torch.float64, "float64": torch.float64,
}
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


_RULES = {
    "momentum": Float(0.0, 1.0, below=True), "nesterov": Bool(), "per_head": Bool(), "ns_steps": Int(0, 99),
    "ns_coefficients": Floats(3), "eps": Float(0.0, above=True), "lr_adjustment": OneOf(LR_ADJUSTMENTS),
    "ns_dtype": OneOf(tuple(NS_DTYPES)), "muon_params": Strings(what="parameter-name patterns (fnmatch)"),
    "adam_params": Strings(what="parameter-name patterns (fnmatch)"), "adam_lr": Float(0.0),
    "adam_betas": Floats(2, Float(0.0, 1.0, below=True)), "adam_eps": Float(0.0),
    "adam_weight_decay": Float(0.0),
    "gather_bucket_size": Int(1), "tensor_parallel": OneOf(TENSOR_PARALLEL_MODES),
}


def parse_muon(params: dict) -> MuonConfig:
    """The :class:`MuonConfig` of an ``optimizer.params`` dict (only read)."""
    out = Section(params, "optimizer.params", {*MUON_PARAM_KEYS, "lr", "weight_decay"}).values(_RULES)
    if "ns_dtype" in out:
        out["ns_dtype"] = NS_DTYPES[out["ns_dtype"]]
    return MuonConfig(**out)
