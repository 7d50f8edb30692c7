"""Validate a DeepSpeed-style ZeRO config dict into a frozen :class:`ZeroConfig`.

Only keys the engine implements are accepted; an unknown key is an error that names it and
lists the keys allowed at that level, and a bad value is an error that names the key and the
allowed values. The caller's dict is only read (a deep copy is kept for checkpoints).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from polyaccel.errors import ConfigError

from .activation_checkpoint import ActivationCheckpointConfig, parse_activation_checkpointing
from .muon_config import MUON_PARAM_KEYS, MuonConfig, parse_muon

OPTIMIZERS = ("adam", "adamw", "lion", "lamb", "muon")
OFFLOAD_DEVICES = ("none", "cpu")

_TOP_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "bf16", "fp16", "optimizer", "zero_optimization", "activation_checkpointing", "checkpoint",
}
_ZERO_KEYS = {
    "stage", "reduce_bucket_size", "overlap_comm", "contiguous_gradients", "stage3_prefetch_bucket_size",
    "prefetch_bucket_size", "stage3_param_persistence_threshold", "offload_optimizer", "offload_param",
    "stage3_leaf_modules", "stage3_check_schedule", "stage3_module_granularity_threshold",
}
_OFFLOAD_KEYS = {"device", "pin_memory", "overlap_step", "ratio"}
#: ``checkpoint.verify``: check every file's checksum when loading (see ``integrity``); false skips it
_CHECKPOINT_KEYS = {"verify"}
_BF16_KEYS = {"enabled"}
_FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"}
_OPTIMIZER_KEYS = {"type", "params"}
_OPT_PARAM_KEYS = {
    "adam": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"},
    "adamw": {"lr", "betas", "eps", "weight_decay", "bias_correction"},
    "lion": {"lr", "betas", "weight_decay"},
    "lamb": {"lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff"},
    "muon": {"lr", "weight_decay", *MUON_PARAM_KEYS},
}


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``type`` and its hyper-parameters (DeepSpeed's names and defaults).

    As in DeepSpeed, ``adam`` applies decoupled weight decay (AdamW) unless ``adam_w_mode`` is false.
    """

    type: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True
    bias_correction: bool = True
    max_coeff: float = 10.0
    min_coeff: float = 0.01
    #: ``type`` "muon": the Muon and auxiliary-Adam settings (see :mod:`.muon_config`); None otherwise
    muon: MuonConfig | None = None


@dataclass(frozen=True)
class OffloadConfig:
    device: str = "none"
    pin_memory: bool = True
    #: offload_optimizer only: step each bucket on the host while backward runs, when the step allows it
    overlap_step: bool = True
    #: offload_optimizer only: the fraction of each partition whose optimizer state and step stay on the host;
    #: the rest (the parameters whose gradients arrive last in backward) stays on the device (see
    #: :mod:`.split_partition`). Rounded to whole gradient buckets (stages 1, 2) or parameters (stage 3).
    ratio: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True)
class Fp16Config:
    enabled: bool = False
    loss_scale: float = 0.0  # 0: dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 1
    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    #: class names or module paths whose whole subtree is gathered at once (see ``stage3``)
    stage3_leaf_modules: tuple[str, ...] = ()
    stage3_check_schedule: bool = True
    #: modules of at most this many parameter elements are gathered whole (0: every module on its own)
    stage3_module_granularity_threshold: int = 0
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    gradient_accumulation_steps: int = 1
    train_micro_batch_size_per_gpu: int | None = None
    train_batch_size: int | None = None
    gradient_clipping: float = 0.0
    bf16: bool = False
    fp16: Fp16Config = field(default_factory=Fp16Config)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    activation_checkpointing: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    #: ``checkpoint.verify``: loads check each file against the checksums recorded at save
    checkpoint_verify: bool = True
    #: the validated input, deep-copied (saved with checkpoints)
    raw: dict = field(default_factory=dict, compare=False, repr=False)


def _check_keys(where: str, value: Any, allowed: set[str]) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"config key {where!r} must be a dict, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(repr(f'{where}.{k}' if where else k) for k in unknown)}; "
            f"allowed keys{' in ' + repr(where) if where else ''}: {', '.join(sorted(allowed))}"
        )
    return value


def _int(key: str, value: Any, minimum: int, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"config key {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(key: str, value: Any, minimum: float = 0.0, strict: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (strict and value == minimum):
        rel = ">" if strict else ">="
        raise ConfigError(f"config key {key!r} must be a finite number {rel} {minimum}, got {value!r}")
    return float(value)


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    return value


def _offload(key: str, value: Any) -> OffloadConfig:
    if value is None:
        return OffloadConfig()
    value = _check_keys(key, value, _OFFLOAD_KEYS)
    device = value.get("device", "none")
    device = "none" if device is None else device
    if device not in OFFLOAD_DEVICES:
        raise ConfigError(
            f"config key '{key}.device' must be one of {', '.join(OFFLOAD_DEVICES)} (got {device!r}; "
            "nvme offload is not implemented)"
        )
    ratio = value.get("ratio", 1.0)
    if not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio <= 1):
        raise ConfigError(f"config key '{key}.ratio' must be a number in (0, 1] (the fraction of the optimizer "
                          f"state kept on the host), got {ratio!r}")
    if ratio != 1 and device != "cpu":
        raise ConfigError(f"config key '{key}.ratio' ({ratio}) needs '{key}.device' 'cpu'")
    return OffloadConfig(device=device, pin_memory=_bool(f"{key}.pin_memory", value.get("pin_memory", True)),
                         overlap_step=_bool(f"{key}.overlap_step", value.get("overlap_step", True)),
                         ratio=float(ratio))


def _optimizer(value: Any) -> OptimizerConfig:
    if value is None:
        return OptimizerConfig()
    value = _check_keys("optimizer", value, _OPTIMIZER_KEYS)
    kind = value.get("type", "adamw")
    if not isinstance(kind, str) or kind.lower() not in OPTIMIZERS:
        raise ConfigError(
            f"config key 'optimizer.type' must be one of {', '.join(OPTIMIZERS)} (any case), got {kind!r}")
    kind = kind.lower()
    params = _check_keys("optimizer.params", value.get("params", {}), _OPT_PARAM_KEYS[kind])
    out: dict[str, Any] = {"type": kind}
    if "lr" in params:
        out["lr"] = _float("optimizer.params.lr", params["lr"])
    if "betas" in params:
        b = params["betas"]
        if (not isinstance(b, (list, tuple)) or len(b) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1 for x in b)):
            raise ConfigError(f"config key 'optimizer.params.betas' must be two numbers in [0, 1), got {b!r}")
        out["betas"] = (float(b[0]), float(b[1]))
    if "eps" in params:
        out["eps"] = _float("optimizer.params.eps", params["eps"])
    if "weight_decay" in params:
        out["weight_decay"] = _float("optimizer.params.weight_decay", params["weight_decay"])
    for key in ("adam_w_mode", "bias_correction"):
        if key in params:
            out[key] = _bool(f"optimizer.params.{key}", params[key])
    for key in ("max_coeff", "min_coeff"):
        if key in params:
            out[key] = _float(f"optimizer.params.{key}", params[key])
    if kind == "adamw":
        out["adam_w_mode"] = True
    if kind == "muon":
        out.setdefault("lr", MuonConfig.DEFAULT_LR)
        out["muon"] = parse_muon(params)
    return OptimizerConfig(**out)


def _fp16(value: Any) -> Fp16Config:
    if value is None:
        return Fp16Config()
    value = _check_keys("fp16", value, _FP16_KEYS)
    out: dict[str, Any] = {"enabled": _bool("fp16.enabled", value.get("enabled", False))}
    if "loss_scale" in value:
        out["loss_scale"] = _float("fp16.loss_scale", value["loss_scale"])
    if "initial_scale_power" in value:
        out["initial_scale_power"] = _int("fp16.initial_scale_power", value["initial_scale_power"], 0)
    if "loss_scale_window" in value:
        out["loss_scale_window"] = _int("fp16.loss_scale_window", value["loss_scale_window"], 1)
    if "hysteresis" in value:
        out["hysteresis"] = _int("fp16.hysteresis", value["hysteresis"], 1)
    if "min_loss_scale" in value:
        out["min_loss_scale"] = _float("fp16.min_loss_scale", value["min_loss_scale"], 0.0, strict=True)
    return Fp16Config(**out)


def _zero_optimization(zero: dict) -> dict[str, Any]:
    """The ZeroConfig fields of the ``zero_optimization`` section."""
    stage = zero.get("stage", 1)
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ConfigError(f"config key 'zero_optimization.stage' must be one of 1, 2, 3, got {stage!r}")
    out: dict[str, Any] = {"stage": stage}
    if "reduce_bucket_size" in zero:
        out["reduce_bucket_size"] = _int("zero_optimization.reduce_bucket_size", zero["reduce_bucket_size"], 1)
    out["overlap_comm"] = _bool("zero_optimization.overlap_comm", zero.get("overlap_comm", stage == 3))
    if "contiguous_gradients" in zero:
        if not _bool("zero_optimization.contiguous_gradients", zero["contiguous_gradients"]):
            raise ConfigError("config key 'zero_optimization.contiguous_gradients' must be true: gradients always "
                              "go through contiguous reduce buckets (false is not implemented)")
    for key in ("stage3_prefetch_bucket_size", "prefetch_bucket_size"):
        if key in zero:
            out["stage3_prefetch_bucket_size"] = _int(f"zero_optimization.{key}", zero[key], 0)
    if "stage3_param_persistence_threshold" in zero:
        out["stage3_param_persistence_threshold"] = _int(
            "zero_optimization.stage3_param_persistence_threshold", zero["stage3_param_persistence_threshold"], 0)
    if "stage3_leaf_modules" in zero:
        leaves = zero["stage3_leaf_modules"]
        if not isinstance(leaves, (list, tuple)) or not all(isinstance(x, str) and x for x in leaves):
            raise ConfigError("config key 'zero_optimization.stage3_leaf_modules' must be a list of module class "
                              f"names or module paths (strings), got {leaves!r}")
        out["stage3_leaf_modules"] = tuple(leaves)
    if "stage3_module_granularity_threshold" in zero:
        out["stage3_module_granularity_threshold"] = _int(
            "zero_optimization.stage3_module_granularity_threshold", zero["stage3_module_granularity_threshold"], 0)
    if "stage3_check_schedule" in zero:
        out["stage3_check_schedule"] = _bool("zero_optimization.stage3_check_schedule", zero["stage3_check_schedule"])
    out["offload_optimizer"] = _offload("zero_optimization.offload_optimizer", zero.get("offload_optimizer"))
    out["offload_param"] = _offload("zero_optimization.offload_param", zero.get("offload_param"))
    if out["offload_param"].ratio != 1:
        raise ConfigError("config key 'zero_optimization.offload_param.ratio' is not supported: parameters are "
                          "offloaded whole; the ratio applies to offload_optimizer")
    if out["offload_optimizer"].ratio != 1 and out["offload_param"].enabled:
        raise ConfigError("config key 'zero_optimization.offload_optimizer.ratio' below 1 is not supported with "
                          "offload_param (the parameters' shards live on the host there); remove the ratio or "
                          "offload_param")
    if out["offload_param"].enabled and stage != 3:
        raise ConfigError(
            f"config key 'zero_optimization.offload_param' needs 'zero_optimization.stage' 3 (got stage {stage}); "
            "use offload_optimizer for stages 1 and 2"
        )
    return out


def _batch_sizes(cfg: dict, world_size: int) -> dict[str, Any]:
    """Micro batch, accumulation steps and global batch: any two given fix the third (DeepSpeed's rule)."""
    gas = _int("gradient_accumulation_steps", cfg.get("gradient_accumulation_steps", 1), 1, allow_none=True) or 1
    micro = _int("train_micro_batch_size_per_gpu", cfg.get("train_micro_batch_size_per_gpu"), 1, allow_none=True)
    total = _int("train_batch_size", cfg.get("train_batch_size"), 1, allow_none=True)
    if total is not None:
        if micro is None:
            if total % (gas * world_size):
                raise ConfigError(
                    f"config key 'train_batch_size' ({total}) must be divisible by gradient_accumulation_steps "
                    f"({gas}) x world size ({world_size})"
                )
            micro = total // (gas * world_size)
        elif "gradient_accumulation_steps" not in cfg:
            if total % (micro * world_size):
                raise ConfigError(
                    f"config key 'train_batch_size' ({total}) must be divisible by train_micro_batch_size_per_gpu "
                    f"({micro}) x world size ({world_size})"
                )
            gas = total // (micro * world_size)
        elif total != micro * gas * world_size:
            raise ConfigError(
                f"config keys disagree: 'train_batch_size' ({total}) must equal train_micro_batch_size_per_gpu "
                f"({micro}) x gradient_accumulation_steps ({gas}) x world size ({world_size})"
            )
    return dict(gradient_accumulation_steps=gas, train_micro_batch_size_per_gpu=micro,
                train_batch_size=total if total is not None else (micro * gas * world_size if micro else None))


def parse_config(config: dict | None, world_size: int = 1) -> ZeroConfig:
    """Validate ``config`` (never modified) for a data-parallel group of ``world_size`` ranks."""
    if config is None:
        config = {}
    raw = copy.deepcopy(config)
    cfg = _check_keys("", raw, _TOP_KEYS)
    out = _zero_optimization(_check_keys("zero_optimization", cfg.get("zero_optimization", {}), _ZERO_KEYS))
    out.update(_batch_sizes(cfg, world_size))
    out["gradient_clipping"] = _float("gradient_clipping", cfg.get("gradient_clipping", 0.0))

    bf16 = cfg.get("bf16")
    bf16_on = _bool("bf16.enabled", _check_keys("bf16", bf16, _BF16_KEYS).get("enabled", False)) if bf16 else False
    fp16 = _fp16(cfg.get("fp16"))
    if bf16_on and fp16.enabled:
        raise ConfigError("config keys 'bf16.enabled' and 'fp16.enabled' are both true; enable at most one")
    out.update(bf16=bf16_on, fp16=fp16, optimizer=_optimizer(cfg.get("optimizer")),
               activation_checkpointing=parse_activation_checkpointing(cfg.get("activation_checkpointing")))
    if out["offload_optimizer"].ratio != 1 and out["optimizer"].type in ("lamb", "muon"):
        raise ConfigError(f"config key 'zero_optimization.offload_optimizer.ratio' below 1 needs an element-wise "
                          f"optimizer (adam, adamw, lion); {out['optimizer'].type} steps whole parameters or "
                          "partitions at once; remove the ratio")
    ckpt = _check_keys("checkpoint", cfg.get("checkpoint", {}), _CHECKPOINT_KEYS)
    out["checkpoint_verify"] = _bool("checkpoint.verify", ckpt.get("verify", True))
    return ZeroConfig(**out, raw=raw)
