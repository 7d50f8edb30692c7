"""Validate a DeepSpeed-style ZeRO config dict into a frozen :class:`ZeroConfig`.

Only keys the engine implements are accepted; an unknown key is an error that names it and
lists the keys allowed at that level, and a bad value is an error that names the key and the
allowed values. The caller's dict is only read (a deep copy is kept for checkpoints).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from polyaccel.config_check import Bool, Float, Floats, Int, OneOf, Section, Strings
from polyaccel.errors import ConfigError

from .activation_checkpoint import ActivationCheckpointConfig, parse_activation_checkpointing
from .muon_config import MUON_PARAM_KEYS, MuonConfig, parse_muon

OPTIMIZERS = ("adam", "adamw", "lion", "lamb", "muon")
OFFLOAD_DEVICES = ("none", "cpu")
STAGES = (1, 2, 3)

_TOP_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "bf16", "fp16", "optimizer", "zero_optimization", "activation_checkpointing", "checkpoint",
}
_ZERO_KEYS = {
    "stage", "reduce_bucket_size", "overlap_comm", "contiguous_gradients", "stage3_prefetch_bucket_size",
    "prefetch_bucket_size", "stage3_param_persistence_threshold", "offload_optimizer", "offload_param",
    "stage3_leaf_modules", "stage3_check_schedule", "stage3_module_granularity_threshold",
}
_OFFLOAD_KEYS = {"device", "pin_memory", "overlap_step", "ratio", "host_threads"}
#: ``checkpoint.verify``: check every file's checksum when loading (see ``integrity``); false skips it
_CHECKPOINT_KEYS = {"verify"}
_BF16_KEYS = {"enabled"}
_FP16_KEYS = {
    "enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
}
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
    #: offload_optimizer only: CPU threads of the host step that overlaps backward; None: one fewer than torch's
    #: intra-op setting (see :mod:`.host_step`)
    host_threads: int | None = None

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


_NUMBER = Float(0.0)
_OPT_RULES = {
    "lr": _NUMBER, "betas": Floats(2, Float(0.0, 1.0, below=True)), "eps": _NUMBER, "weight_decay": _NUMBER,
    "adam_w_mode": Bool(), "bias_correction": Bool(), "max_coeff": _NUMBER, "min_coeff": _NUMBER,
}
_FP16_RULES = {
    "loss_scale": _NUMBER, "initial_scale_power": Int(0), "loss_scale_window": Int(1), "hysteresis": Int(1),
    "min_loss_scale": Float(0.0, above=True),
}
_ZERO_RULES = {
    "reduce_bucket_size": Int(1), "stage3_param_persistence_threshold": Int(0),
    "stage3_leaf_modules": Strings(what="module class names or module paths"),
    "stage3_module_granularity_threshold": Int(0), "stage3_check_schedule": Bool(),
}


def _offload(parent: Section, key: str) -> OffloadConfig:
    sec = parent.section(key, _OFFLOAD_KEYS)
    device = sec.get("device", OneOf(OFFLOAD_DEVICES, optional=True), "none",
                     hint="nvme offload is not implemented")
    ratio = sec.get("ratio", Float(0.0, 1.0, above=True), 1.0,
                    hint="the fraction of the optimizer state kept on the host")
    if ratio != 1 and device != "cpu":
        raise sec.error("ratio", f"({ratio}) needs {sec.key('device')!r} 'cpu'")
    return OffloadConfig(device=device, pin_memory=sec.get("pin_memory", Bool(), True),
                         overlap_step=sec.get("overlap_step", Bool(), True), ratio=ratio,
                         host_threads=sec.get("host_threads", Int(1, optional=True), None,
                                              hint="the overlapped host step's CPU threads; null: one fewer "
                                                   "than torch's"))


def _optimizer(value: Any) -> OptimizerConfig:
    sec = Section(value, "optimizer", _OPTIMIZER_KEYS)
    kind = sec.get("type", OneOf(OPTIMIZERS), "adamw")
    params = sec.section("params", _OPT_PARAM_KEYS[kind])
    out: dict[str, Any] = {"type": kind, **params.values(_OPT_RULES)}
    if kind == "adamw":
        out["adam_w_mode"] = True
    if kind == "muon":
        out.setdefault("lr", MuonConfig.DEFAULT_LR)
        out["muon"] = parse_muon(sec.raw("params") or {})
    return OptimizerConfig(**out)


def _fp16(value: Any) -> Fp16Config:
    sec = Section(value, "fp16", _FP16_KEYS)
    return Fp16Config(enabled=sec.get("enabled", Bool(), False), **sec.values(_FP16_RULES))


def _zero_optimization(zero: Section) -> dict[str, Any]:
    """The ZeroConfig fields of the ``zero_optimization`` section."""
    stage = zero.get("stage", OneOf(STAGES), 1)
    out: dict[str, Any] = {"stage": stage, **zero.values(_ZERO_RULES)}
    out["overlap_comm"] = zero.get("overlap_comm", Bool(), stage == 3)
    if not zero.get("contiguous_gradients", Bool(), True):
        raise zero.error("contiguous_gradients", "must be true: gradients always go through contiguous "
                         "reduce buckets (false is not implemented)")
    for key in ("stage3_prefetch_bucket_size", "prefetch_bucket_size"):
        if key in zero:
            out["stage3_prefetch_bucket_size"] = zero.get(key, Int(0))
    out["offload_optimizer"] = _offload(zero, "offload_optimizer")
    out["offload_param"] = _offload(zero, "offload_param")
    _check_offload(out, stage)
    return out


def _check_offload(out: dict[str, Any], stage: int) -> None:
    """What the two offload sections allow together, and at ``stage``."""
    if out["offload_param"].ratio != 1:
        raise ConfigError("config key 'zero_optimization.offload_param.ratio' is not supported: parameters "
                          "are offloaded whole; the ratio applies to offload_optimizer")
    if out["offload_param"].host_threads is not None:
        raise ConfigError("config key 'zero_optimization.offload_param.host_threads' is not supported: the host "
                          "step's threads are set under offload_optimizer")
    if out["offload_optimizer"].ratio != 1 and out["offload_param"].enabled:
        raise ConfigError("config key 'zero_optimization.offload_optimizer.ratio' below 1 is not supported "
                          "with offload_param (the parameters' shards live on the host there); remove the "
                          "ratio or offload_param")
    if out["offload_param"].enabled and stage != 3:
        raise ConfigError(f"config key 'zero_optimization.offload_param' needs 'zero_optimization.stage' 3 "
                          f"(got stage {stage}); use offload_optimizer for stages 1 and 2")


def _batch_sizes(cfg: Section, world_size: int) -> dict[str, Any]:
    """Micro batch, accumulation steps and global batch: any two given fix the third (DeepSpeed's rule)."""
    size = Int(1, optional=True)
    gas = cfg.get("gradient_accumulation_steps", size, 1)
    micro = cfg.get("train_micro_batch_size_per_gpu", size)
    total = cfg.get("train_batch_size", size)
    if total is not None:
        if micro is None:
            if total % (gas * world_size):
                raise ConfigError(
                    f"config key 'train_batch_size' ({total}) must be divisible by "
                    f"gradient_accumulation_steps ({gas}) x world size ({world_size})"
                )
            micro = total // (gas * world_size)
        elif "gradient_accumulation_steps" not in cfg:
            if total % (micro * world_size):
                raise ConfigError(
                    f"config key 'train_batch_size' ({total}) must be divisible by "
                    f"train_micro_batch_size_per_gpu ({micro}) x world size ({world_size})"
                )
            gas = total // (micro * world_size)
        elif total != micro * gas * world_size:
            raise ConfigError(
                f"config keys disagree: 'train_batch_size' ({total}) must equal "
                f"train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps ({gas}) x world "
                f"size ({world_size})"
            )
    if total is None and micro:
        total = micro * gas * world_size
    return dict(gradient_accumulation_steps=gas, train_micro_batch_size_per_gpu=micro, train_batch_size=total)


def parse_config(config: dict | None, world_size: int = 1) -> ZeroConfig:
    """Validate ``config`` (never modified) for a data-parallel group of ``world_size`` ranks."""
    raw = copy.deepcopy(config if config is not None else {})
    cfg = Section(raw, "", _TOP_KEYS)
    out = _zero_optimization(cfg.section("zero_optimization", _ZERO_KEYS))
    out.update(_batch_sizes(cfg, world_size))
    out["gradient_clipping"] = cfg.get("gradient_clipping", _NUMBER, 0.0)
    bf16_on = cfg.section("bf16", _BF16_KEYS).get("enabled", Bool(), False)
    fp16 = _fp16(cfg.raw("fp16"))
    if bf16_on and fp16.enabled:
        raise ConfigError("config keys 'bf16.enabled' and 'fp16.enabled' are both true; enable at most one")
    out.update(bf16=bf16_on, fp16=fp16, optimizer=_optimizer(cfg.raw("optimizer")),
               activation_checkpointing=parse_activation_checkpointing(cfg.raw("activation_checkpointing")))
    if out["offload_optimizer"].ratio != 1 and out["optimizer"].type in ("lamb", "muon"):
        raise ConfigError(f"config key 'zero_optimization.offload_optimizer.ratio' below 1 needs an "
                          f"element-wise optimizer (adam, adamw, lion); {out['optimizer'].type} steps whole "
                          "parameters or partitions at once; remove the ratio")
    out["checkpoint_verify"] = cfg.section("checkpoint", _CHECKPOINT_KEYS).get("verify", Bool(), True)
    return ZeroConfig(**out, raw=raw)
