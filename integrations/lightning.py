"""polyaccel in PyTorch Lightning: an accelerator for the selected plugin and a strategy that trains through
the polyaccel engine.

Install ``polyaccel[lightning]``. Importing this module changes nothing in Lightning: the names
``"polyaccel"`` (and the plugins') enter Lightning's registries when a :class:`PolyaccelStrategy` is
constructed or :func:`register` is called (see docs/integrations-lightning.md)::

    from polyaccel.integrations.lightning import PolyaccelStrategy

    trainer = L.Trainer(accelerator="polyaccel", devices=2, strategy=PolyaccelStrategy(stage=3))
    trainer.fit(module)                      # ckpt_path=... resumes from a checkpoint it wrote

    polyaccel.integrations.lightning.register()   # for names alone: Trainer(accelerator="polyaccel")

- :class:`PolyaccelAccelerator` is the selected polyaccel plugin as a Lightning accelerator, registered
  as ``"polyaccel"``; every other available plugin is registered under its own name (``"example"``,
  ``"npu"`` ...) unless Lightning already has that name (``cpu``, ``cuda``, ``mps`` stay Lightning's),
  and choosing it selects that plugin in polyaccel.
- :class:`PolyaccelStrategy` (registered as ``"polyaccel"``) wraps the LightningModule with
  :func:`polyaccel.initialize` (ZeRO stages 1-3, offload, AutoTP/AutoEP when the config names them):
  backward, clipping and the optimizer step are the engine's; the optimizer comes from
  ``configure_optimizers`` (Adam, AdamW and polyaccel's fused optimizers, and torch.optim.Muon with an
  AdamW under manual optimization, are translated into the engine's config, their param groups' weight
  decays into the engine's ``param_groups``, and their LR schedulers keep working) or from the config's
  ``optimizer`` section.
  Checkpoints are directories: the engine's sharded checkpoint plus ``lightning.pt`` (loops,
  callbacks, schedulers, loaded with torch's ``weights_only`` loader) and ``polyaccel-files.json``
  (its checksum, checked before a resume reads anything); ``polyaccel zero-to-fp32`` consolidates the weights.
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import polyaccel
import torch
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from polyaccel import selection
from polyaccel.errors import CheckpointError, ConfigError, PolyaccelError
from polyaccel.safe_files import write_bytes

from ._checkpoint_files import load_refusal, verify, write_manifest
from ._engine import EngineAdapter, check_data_axis, data_axis, sequence_axis
from ._sequence import check_sequence_axis, split_for_sequence, whole_sequence_loss, whole_sequence_value

#: file in a checkpoint directory holding Lightning's own state (loops, callbacks, schedulers)
LIGHTNING_STATE = "lightning.pt"
ENGINE_TAG = "checkpoint"


# ------------------------------------------------------------------------------------------- accelerator
class PolyaccelAccelerator(Accelerator):
    """The selected polyaccel accelerator (or, in a subclass from :func:`accelerator_class`, a named plugin)."""

    #: polyaccel plugin name this class stands for; None: whatever polyaccel selects
    plugin: str | None = None

    def __init__(self) -> None:
        super().__init__()
        if self.plugin is not None and getattr(selection.selected_or_none(), "name", None) != self.plugin:
            polyaccel.set_accelerator(self.plugin)  # choosing it in Lightning chooses it in polyaccel

    @classmethod
    def polyaccel_accelerator(cls):
        if cls.plugin is not None:
            sel = selection.selected_or_none()
            if sel is not None and sel.name == cls.plugin:
                return sel
            rec = selection.plugins().find(cls.plugin)
            if rec is None or rec.accelerator is None:
                raise ConfigError(f"no polyaccel plugin named {cls.plugin!r} is available")
            return rec.accelerator
        return polyaccel.get_accelerator()

    def setup_device(self, device: torch.device) -> None:
        acc = self.polyaccel_accelerator()
        if device.type != acc.device(0).type:
            if device.type == "cpu":
                return  # Lightning's one-device default strategy: setup() moves it to our device
            raise ConfigError(f"the polyaccel accelerator {acc.name!r} runs on {acc.device(0).type!r} devices, "
                              f"but Lightning chose {device}")
        if device.index is not None and device.type != "cpu":
            acc.set_device(device.index)

    def setup(self, trainer: pl.Trainer) -> None:
        # Lightning gives a custom one-device accelerator SingleDeviceStrategy(device="cpu"): put it on our device
        strategy = trainer.strategy
        acc = self.polyaccel_accelerator()
        if isinstance(strategy, SingleDeviceStrategy) and strategy.root_device.type != acc.device(0).type:
            strategy._root_device = acc.device(0)
            self.setup_device(strategy._root_device)

    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        acc = self.polyaccel_accelerator()
        if acc.device_type == "cpu":
            return {}
        try:
            return {"allocated_bytes": acc.memory_allocated(), "max_allocated_bytes": acc.max_memory_allocated()}
        except Exception:  # noqa: BLE001 - stats are best effort (an emulated or limited runtime)
            return {}

    def teardown(self) -> None:
        pass

    @classmethod
    def parse_devices(cls, devices: int | str | list[int]) -> int | list[int]:
        if isinstance(devices, str):
            devices = devices.strip()
            if devices in ("auto", "-1"):
                return cls.auto_device_count()
            if "," in devices:
                return [int(x) for x in devices.split(",") if x.strip()]
            devices = int(devices)
        if isinstance(devices, int) and devices == -1:
            return cls.auto_device_count()
        if isinstance(devices, int) and devices < 1:
            raise ConfigError(f"devices must be >= 1 (or 'auto'/-1), got {devices}")
        return devices

    @classmethod
    def get_parallel_devices(cls, devices: int | list[int]) -> list[torch.device]:
        acc = cls.polyaccel_accelerator()
        indices = list(range(devices)) if isinstance(devices, int) else list(devices)
        if acc.device(0).type == "cpu":  # host devices (or an emulated runtime): one per process
            return [torch.device("cpu")] * len(indices)
        return [acc.device(i) for i in indices]

    @classmethod
    def auto_device_count(cls) -> int:
        acc = cls.polyaccel_accelerator()
        return 1 if acc.device(0).type == "cpu" else max(1, acc.device_count())

    @classmethod
    def is_available(cls) -> bool:
        try:
            return bool(cls.polyaccel_accelerator().probe().available)
        except Exception:  # noqa: BLE001 - "not available" is the answer Lightning asks for
            return False

    @classmethod
    def name(cls) -> str:
        return cls.plugin or "polyaccel"

    @classmethod
    def register_accelerators(cls, accelerator_registry) -> None:
        register_accelerators(accelerator_registry)


def accelerator_class(plugin: str) -> type[PolyaccelAccelerator]:
    """A Lightning accelerator class standing for the polyaccel plugin ``plugin``."""
    return type(f"PolyaccelAccelerator_{plugin}", (PolyaccelAccelerator,), {"plugin": plugin})


def register_accelerators(registry=AcceleratorRegistry) -> list[str]:
    """Register ``"polyaccel"`` and every available polyaccel plugin's name Lightning does not already use.
    Returns the names registered."""
    names = []
    if "polyaccel" not in registry:
        registry.register("polyaccel", PolyaccelAccelerator, description="the selected polyaccel plugin")
        names.append("polyaccel")
    for rec in selection.plugins().usable():
        if rec.accelerator_cls is None:
            continue
        name = rec.accelerator_cls.name
        if name in registry:
            continue
        registry.register(name, accelerator_class(name), description=f"polyaccel plugin {name!r}")
        names.append(name)
    return names


# ------------------------------------------------------------------------------------------- precision
_PRECISIONS = {"32-true": None, "32": None, 32: None, "64-true": "fp64", "64": "fp64", 64: "fp64",
               "bf16-mixed": "bf16", "bf16-true": "bf16", "bf16": "bf16",
               "16-mixed": "fp16", "16-true": "fp16", "16": "fp16", 16: "fp16"}


def _precision_name(plugin: Precision) -> str:
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

    if isinstance(plugin, PolyaccelPrecision):
        return plugin.precision
    if isinstance(plugin, DoublePrecision):
        return "64-true"
    if isinstance(plugin, (HalfPrecision, MixedPrecision)):
        return plugin.precision
    if type(plugin) is Precision:
        return "32-true"
    raise ConfigError(f"PolyaccelStrategy cannot use the precision plugin {type(plugin).__name__}; "
                      "pass Trainer(precision='32-true' | '64-true' | 'bf16-mixed' | '16-mixed')")


class PolyaccelPrecision(Precision):
    """Precision handled by the engine: bf16/fp16 weights with fp32 masters (and fp16 loss scaling);
    backward and the optimizer step go to the engine, clipping is the engine's ``gradient_clipping``."""

    def __init__(self, precision: str | int = "32-true") -> None:
        if precision not in _PRECISIONS:
            raise ConfigError(f"PolyaccelStrategy does not support precision {precision!r}; "
                              f"choose one of {sorted(str(p) for p in _PRECISIONS)}")
        self.precision = str(precision)
        self.kind = _PRECISIONS[precision]

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.double() if self.kind == "fp64" else module  # the engine casts to bf16/fp16 itself

    def convert_input(self, data: Any) -> Any:
        dtype = {"fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}.get(self.kind)
        if dtype is None:
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        model.trainer.strategy.polyaccel_engine.backward(tensor)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        closure_result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and closure_result is None:
            raise ConfigError("returning None from training_step (skipping backward) is not supported by "
                              "PolyaccelStrategy: every rank must take part in each step")
        optimizer.step()
        return closure_result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        pass  # the engine clips to gradient_clipping inside its step


# ------------------------------------------------------------------------------------------- checkpoint state
def _state_globals() -> list:
    """Types Lightning's own state may hold beyond what torch's ``weights_only`` loader allows by itself."""
    from lightning.fabric.utilities.data import AttributeDict

    return [AttributeDict]


def _serialize_state(state: dict, path: str) -> tuple[bytes | None, str | None]:
    """(bytes, None) of ``state`` as ``torch.save`` writes it, or (None, why) when the ``weights_only`` loader
    would refuse it at resume (a value of a type it does not allow, e.g. a custom object in hparams)."""
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    try:
        with torch.serialization.safe_globals(_state_globals()):
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any refusal: the state must be plain to be saved
        return None, (f"{path}: Lightning's state (loops, callbacks, schedulers, hparams) holds a value a resume "
                      f"could not load ({load_refusal(exc)}); keep plain values (numbers, strings, lists, dicts, "
                      "tensors) in hparams and callback states")
    return data, None


def _load_state(path: str, fix: str) -> dict:
    try:
        with torch.serialization.safe_globals(_state_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unreadable or refused: never unpickled beyond weights_only
        raise CheckpointError(f"{path}: cannot be loaded safely ({load_refusal(exc)}); {fix}", path) from None


# ------------------------------------------------------------------------------------------- strategy
class _EngineModule(torch.nn.Module):
    """``strategy.model``: the LightningModule's steps run through the engine's forward."""

    def __init__(self, module: torch.nn.Module, adapter: EngineAdapter):
        super().__init__()
        self.module = module
        self.adapter = adapter

    def forward(self, *args, **kwargs):
        return self.adapter.engine(*args, **kwargs)


class _MuonPair:
    """torch.optim.Muon and its AdamW from ``configure_optimizers``, one Muon optimizer in the engine: Lightning
    (manual optimization) steps each once per batch, and the engine steps when both have. The engine scales the
    auxiliary Adam's lr with Muon's (``adam_lr * lr / initial lr``), so an AdamW lr that a schedule moved otherwise
    is refused rather than silently replaced."""

    def __init__(self, adapter: EngineAdapter, muon: torch.optim.Optimizer, adam: torch.optim.Optimizer):
        self.adapter, self.muon, self.adam = adapter, muon, adam
        self.muon_lr0, self.adam_lr0 = float(muon.param_groups[0]["lr"]), float(adam.param_groups[0]["lr"])
        self.stepped: list[torch.optim.Optimizer] = []

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if any(o is optimizer for o in self.stepped):
            raise ConfigError(f"{type(optimizer).__name__} stepped twice before "
                              f"{type(self.adam if optimizer is self.muon else self.muon).__name__}: the polyaccel "
                              "engine steps Muon and its AdamW together; step each once per batch")
        self.stepped.append(optimizer)
        if len(self.stepped) < 2:
            return
        self.stepped = []
        lr, adam_lr = float(self.muon.param_groups[0]["lr"]), float(self.adam.param_groups[0]["lr"])
        want = self.adam_lr0 * lr / self.muon_lr0 if self.muon_lr0 > 0 else self.adam_lr0
        if abs(adam_lr - want) > 1e-12 * max(abs(want), 1e-30):
            raise ConfigError(f"{type(self.adam).__name__}'s lr is {adam_lr!r}, but the polyaccel engine moves the "
                              f"auxiliary Adam's lr with Muon's (initial {self.adam_lr0!r} x {lr!r} / "
                              f"{self.muon_lr0!r} = {want!r}): schedule both optimizers by the same factor")
        self.adapter.engine.set_lr(lr)
        self.adapter.step(boundary=True)
        for o in (self.muon, self.adam):
            o._opt_called = True  # see _EngineOptimizer.step


class _EngineOptimizer(torch.optim.Optimizer):
    """The optimizer Lightning steps: it shares the param groups of the optimizer ``configure_optimizers``
    returned (so that optimizer's LR schedulers keep working) and steps the engine with their lr."""

    def __init__(self, adapter: EngineAdapter, source: torch.optim.Optimizer | None, lr: float,
                 pair: _MuonPair | None = None):
        super().__init__([torch.zeros(0)], {"lr": lr})
        if source is not None:
            self.param_groups = source.param_groups
            self.defaults = source.defaults
        self._adapter = adapter
        self._source = source
        self._pair = pair

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if self._pair is not None:
            self._pair.step(self._source)
            return loss
        self._adapter.engine.set_lr(self.param_groups[0]["lr"])
        self._adapter.step(boundary=True)
        if self._source is not None:
            # torch's LR schedulers wrap their optimizer's ``step`` so that it sets ``_opt_called``, and warn
            # "Detected call of `lr_scheduler.step()` before `optimizer.step()`" at their first step when it is
            # unset. The schedulers hold the source optimizer, whose step the engine's replaces: record the call.
            self._source._opt_called = True
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the engine zeroes its gradients after each step

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": [{"lr": g["lr"]} for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict) -> None:
        for group, saved in zip(self.param_groups, state_dict.get("param_groups", []), strict=False):
            group["lr"] = saved["lr"]


#: param-group keys that may differ between groups: the engine takes a weight decay per group (see
#: :func:`weight_decay_groups`); every other hyperparameter is one for all parameters
_PER_GROUP_KEYS = ("params", "weight_decay", "name")


def _groups_agree(optimizer: torch.optim.Optimizer) -> None:
    """Every param group of ``optimizer`` has group 0's hyperparameters but for the per-group keys."""
    groups = optimizer.param_groups
    keys = [k for k in groups[0] if k not in _PER_GROUP_KEYS]
    for i, g in enumerate(groups[1:], 1):
        differ = sorted(k for k in set(keys) | (set(g) - set(_PER_GROUP_KEYS)) if g.get(k) != groups[0].get(k))
        if differ:
            raise ConfigError(f"{type(optimizer).__name__}'s param group {i} has a different "
                              f"{', '.join(repr(k) for k in differ)} than group 0; the polyaccel engine varies only "
                              "weight_decay per group: give every group the same other hyperparameters, or set "
                              "the config's 'optimizer' section")


def optimizer_config(optimizer: torch.optim.Optimizer) -> dict:
    """The engine's ``optimizer`` config section for a torch or polyaccel optimizer with one set of
    hyperparameters (several param groups are allowed when only their ``weight_decay`` differs: the engine
    gets those from :func:`weight_decay_groups`)."""
    groups = optimizer.param_groups
    _groups_agree(optimizer)
    g = groups[0]
    name = type(optimizer).__name__
    _refuse_dropped_settings(optimizer, g)
    decay = optimizer.defaults.get("weight_decay", g.get("weight_decay", 0.0)) if len(groups) > 1 \
        else g.get("weight_decay", 0.0)
    params: dict = {"lr": float(g["lr"]), "weight_decay": float(decay)}
    if "betas" in g:
        params["betas"] = [float(b) for b in g["betas"]]
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        decoupled = isinstance(optimizer, torch.optim.AdamW) or g.get("decoupled_weight_decay", False)
        params["eps"] = float(g["eps"])
        if not decoupled:
            params["adam_w_mode"] = False  # torch's Adam: L2 weight decay
        return {"type": "adamw" if decoupled else "adam", "params": params}
    if isinstance(optimizer, polyaccel.optim.FusedAdam):
        params.update(eps=float(g["eps"]), adam_w_mode=bool(g["adam_w_mode"]),
                      bias_correction=bool(g["bias_correction"]))
        return {"type": "adam", "params": params}
    if isinstance(optimizer, polyaccel.optim.FusedLion):
        return {"type": "lion", "params": params}
    if isinstance(optimizer, polyaccel.optim.FusedLamb):
        params.update(eps=float(g["eps"]), bias_correction=bool(g["bias_correction"]),
                      max_coeff=float(g["max_coeff"]), min_coeff=float(g["min_coeff"]))
        return {"type": "lamb", "params": params}
    raise ConfigError(f"PolyaccelStrategy cannot translate {name} into the engine's optimizer (Adam, AdamW and "
                      "polyaccel.optim.FusedAdam/FusedLion/FusedLamb can); set the config's 'optimizer' section")


#: param-group keys each optimizer maps into the engine's config (plus the per-group keys)
_MAPPED = {
    "Adam": {"lr", "betas", "eps", "weight_decay", "decoupled_weight_decay"},
    "FusedAdam": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"},
    "FusedLion": {"lr", "betas", "weight_decay"},
    "FusedLamb": {"lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff"},
    "Muon": {"lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn"},
}
#: torch settings that choose how torch would run the same step (one kernel per tensor, a multi-tensor kernel, a
#: fused kernel): carried as what they ask, the engine's step being one fused multi-tensor kernel whatever they say
_IMPLEMENTATION = {"foreach", "fused"}
#: torch settings that change what a step computes, with the value the engine's step has; another value is refused
_BEHAVIOUR = {"maximize": False, "amsgrad": False, "capturable": False, "differentiable": False}
#: keys torch's LR schedulers add to param groups: the lr they drive reaches the engine at every step
_SCHEDULER_KEYS = {"initial_lr", "max_lr", "min_lr", "base_lr"}
_WHY = {
    "maximize": "the engine always descends (negate the loss instead)",
    "amsgrad": "the engine's Adam keeps no maximum of the second moments",
    "capturable": "the engine's step is not captured in torch's device graphs",
    "differentiable": "the engine's step is not differentiable",
    "max_momentum": "a scheduler cycling the momentum (betas) would move it at every step, which the engine does "
                    "not follow; pass cycle_momentum=False",
    "base_momentum": "a scheduler cycling the momentum (betas) would move it at every step, which the engine does "
                     "not follow; pass cycle_momentum=False",
}


def _refuse_dropped_settings(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """Every key of ``group`` is mapped, an implementation choice, a scheduler's bookkeeping or a behaviour at the
    engine's value; anything else is a setting the engine would drop: :class:`ConfigError` naming it."""
    name = type(optimizer).__name__
    mapped = next((keys for cls, keys in _MAPPED.items()
                   if any(c.__name__ == cls for c in type(optimizer).__mro__)), None)
    if mapped is None:
        return  # the caller refuses the type itself
    for key, value in group.items():
        if key in mapped or key in _PER_GROUP_KEYS or key in _IMPLEMENTATION or key in _SCHEDULER_KEYS:
            continue
        if key in _BEHAVIOUR and value == _BEHAVIOUR[key]:
            continue
        if key in _BEHAVIOUR or key in _WHY:
            raise ConfigError(f"{name}({key}={value!r}) cannot be carried into the polyaccel engine: {_WHY[key]}; "
                              f"drop {key}, or set the config's 'optimizer' section")
        raise ConfigError(f"{name}'s param group holds {key!r} = {value!r}, a setting the polyaccel engine has no "
                          f"place for (it maps {', '.join(sorted(mapped))}); drop it, or set the config's "
                          "'optimizer' section")


def optimizer_covers_module(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> torch.optim.Optimizer:
    """``optimizer`` when it steps every trainable parameter of ``module``: the engine steps them all, so a
    parameter left out (one the optimizer would never change) is refused by name; returns ``optimizer``."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    left = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in held]
    if left:
        shown = ", ".join(repr(n) for n in left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        raise ConfigError(f"{type(optimizer).__name__} from configure_optimizers leaves out the trainable parameter(s) "
                          f"{shown}, which it would never change; the polyaccel engine steps every trainable "
                          "parameter: freeze them (requires_grad_(False)) or give them to the optimizer")
    return optimizer


#: torch.optim.Muon's ``adjust_lr_fn`` as the engine's ``lr_adjustment``
_LR_ADJUSTMENTS = {None: "original", "original": "original", "match_rms_adamw": "match_rms_adamw"}


def _name_pattern(name: str) -> str:
    """An fnmatch pattern matching exactly ``name`` (``*``, ``?`` and ``[`` taken literally)."""
    import re

    return re.sub(r"([*?\[])", r"[\1]", name)


def _group_names(optimizer: torch.optim.Optimizer, i: int, names: dict[int, str]) -> list[str]:
    """The module's names of the parameters in ``optimizer``'s param group ``i`` (a foreign tensor refused)."""
    out = []
    for p in optimizer.param_groups[i]["params"]:
        if id(p) not in names:
            raise ConfigError(f"{type(optimizer).__name__}'s param group {i} holds a tensor of shape "
                              f"{tuple(p.shape)} that is not a parameter of the LightningModule; optimize the "
                              "module's own parameters (self.parameters() or self.named_parameters())")
        out.append(names[id(p)])
    return out


def _names_of(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
    return [n for i in range(len(optimizer.param_groups)) for n in _group_names(optimizer, i, names)]


def muon_optimizer_config(muon: torch.optim.Optimizer, adam: torch.optim.Optimizer | None,
                          module: torch.nn.Module) -> tuple[dict, list[dict]]:
    """The engine's ``optimizer`` section (``type: "muon"``) and ``param_groups`` for ``torch.optim.Muon`` over
    the hidden matrices and ``adam`` (torch's AdamW, or Adam without L2 decay; None when Muon holds every trainable
    parameter) over the rest: Muon's settings under their engine names, the Adam's as ``adam_*``, and each
    optimizer's parameters by exact name (``muon_params`` / ``adam_params``). ``param_groups`` carries the weight
    decay of each param group when an optimizer has several (empty otherwise). What the engine would not step
    exactly as these two optimizers is refused with a :class:`ConfigError` naming it."""
    if not isinstance(muon, torch.optim.Muon):
        raise ConfigError(f"expected torch.optim.Muon, got {type(muon).__name__}")
    names = {id(p): n for n, p in module.named_parameters()}
    params, muon_names = _muon_settings(muon, names, dict(module.named_parameters()))
    groups = [(muon, muon_names)]
    if adam is not None:
        adam_params, adam_names = _adam_settings(adam, names, muon_names)
        params.update(adam_params)
        groups.append((adam, adam_names))
    held = {n for _, ns in groups for n in ns}
    left = [n for n, p in module.named_parameters() if p.requires_grad and n not in held]
    if left:
        shown = ", ".join(repr(n) for n in left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        raise ConfigError(f"the optimizers from configure_optimizers leave out the trainable parameter(s) {shown}, "
                          "which they would never change; the polyaccel engine steps every trainable parameter: "
                          "freeze them (requires_grad_(False)) or give them to Muon (2-D) or the AdamW")
    param_groups = []
    if any(len(opt.param_groups) > 1 for opt, _ in groups):
        for opt, _ in groups:
            for grp in opt.param_groups:
                param_groups.append({"params": [names[id(p)] for p in grp["params"]],
                                     "weight_decay": float(grp.get("weight_decay", 0.0))})
    return {"type": "muon", "params": params}, param_groups


def _muon_settings(muon: torch.optim.Optimizer, names: dict[int, str],
                   by_name: dict) -> tuple[dict, list[str]]:
    """torch.optim.Muon's settings under the engine's names, with its parameters by exact name; and those
    names."""
    _groups_agree(muon)
    g = muon.param_groups[0]
    _refuse_dropped_settings(muon, g)
    muon_names = _names_of(muon, names)
    flat = [n for n in muon_names if by_name[n].dim() != 2]
    if flat:
        raise ConfigError(f"Muon holds the parameter {flat[0]!r} of shape {tuple(by_name[flat[0]].shape)}; "
                          "Muon steps 2-D matrices only: give it to the AdamW")
    adjust = g.get("adjust_lr_fn")
    if adjust not in _LR_ADJUSTMENTS:
        raise ConfigError(f"Muon(adjust_lr_fn={adjust!r}) has no engine equivalent (None, 'original', "
                          "'match_rms_adamw' do)")
    return {"lr": float(g["lr"]), "weight_decay": float(g["weight_decay"]),
            "momentum": float(g["momentum"]), "nesterov": bool(g["nesterov"]),
            "ns_steps": int(g["ns_steps"]), "ns_coefficients": [float(c) for c in g["ns_coefficients"]],
            "eps": float(g["eps"]), "lr_adjustment": _LR_ADJUSTMENTS[adjust],
            "ns_dtype": "bf16",  # torch.optim.Muon's Newton-Schulz iteration runs in bf16
            "muon_params": [_name_pattern(n) for n in muon_names]}, muon_names


def _adam_settings(adam: torch.optim.Optimizer, names: dict[int, str],
                   muon_names: list[str]) -> tuple[dict, list[str]]:
    """The auxiliary AdamW's settings as the engine's ``adam_*`` keys, refused where the engine would differ;
    and the names of its parameters."""
    if not isinstance(adam, torch.optim.Adam):  # AdamW is an Adam
        raise ConfigError(f"PolyaccelStrategy pairs torch.optim.Muon with torch.optim.AdamW or Adam (the "
                          f"engine's auxiliary optimizer is an AdamW), not {type(adam).__name__}")
    _groups_agree(adam)
    a = adam.param_groups[0]
    _refuse_dropped_settings(adam, a)
    decoupled = isinstance(adam, torch.optim.AdamW) or a.get("decoupled_weight_decay", False)
    l2 = [float(x.get("weight_decay", 0.0)) for x in adam.param_groups if x.get("weight_decay", 0.0)]
    if not decoupled and l2:
        raise ConfigError(f"Adam(weight_decay={l2[0]}) paired with Muon adds L2 decay to the gradient, but "
                          "the engine's auxiliary optimizer is an AdamW (decoupled decay): use "
                          "torch.optim.AdamW")
    adam_names = _names_of(adam, names)
    both = sorted(set(adam_names) & set(muon_names))
    if both:
        raise ConfigError(f"the parameter {both[0]!r} is in both Muon and {type(adam).__name__}; give each "
                          "parameter to one optimizer")
    return {"adam_params": [_name_pattern(n) for n in adam_names], "adam_lr": float(a["lr"]),
            "adam_betas": [float(b) for b in a["betas"]], "adam_eps": float(a["eps"]),
            "adam_weight_decay": float(a.get("weight_decay", 0.0))}, adam_names


def weight_decay_groups(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> list[dict]:
    """The engine's ``param_groups`` for ``optimizer``'s param groups: each group's parameters by their name in
    ``module`` with the group's weight decay (names, not tensors: a model layer such as tensor_parallel may
    replace the tensors). Empty for one group (the config's ``weight_decay`` is its decay)."""
    if len(optimizer.param_groups) < 2:
        return []
    names = {id(p): n for n, p in module.named_parameters()}
    return [{"params": _group_names(optimizer, i, names), "weight_decay": float(g.get("weight_decay", 0.0))}
            for i, g in enumerate(optimizer.param_groups)]


class PolyaccelStrategy(DDPStrategy):
    """Train a LightningModule through :func:`polyaccel.initialize` on every rank.

    ``stage`` (1-3) and ``config`` (the engine's DeepSpeed-style config; ``stage`` fills
    ``zero_optimization.stage`` when the config has none) configure the engine; ``engine`` names it
    in the ``polyaccel.engines`` entry-point group. From the Trainer: ``gradient_clip_val`` (norm
    clipping) and ``precision`` fill the config where it says nothing. ``accumulate_grad_batches``
    stays Lightning's: the engine's backward runs on every batch and its step at Lightning's optimizer
    steps, so ``trainer.global_step`` counts optimizer steps as usual.

    After ``fit`` starts, ``strategy.polyaccel_engine`` is the engine (an :class:`EngineAdapter`) and
    ``strategy.polyaccel_config`` the config it was given.
    """

    strategy_name = "polyaccel"
    #: this rank's place in its sequence group (sequence_parallel), set with the engine
    _sp_rank, _sp_size = 0, 1

    def __init__(self, stage: int | None = None, config: dict | None = None, *, engine: str = "zero",
                 **kwargs: Any) -> None:
        register()  # a Trainer built with this strategy finds accelerator="polyaccel" (and plugins' names)
        super().__init__(**kwargs)
        cfg = copy.deepcopy(config) if config else {}
        if stage is not None:
            zero = cfg.setdefault("zero_optimization", {})
            if zero.get("stage", stage) != stage:
                raise ConfigError(f"stage={stage} but config['zero_optimization']['stage'] is {zero['stage']}")
            zero["stage"] = stage
        self.config = cfg
        self.engine_name = engine
        self.polyaccel_config: dict | None = None
        self.polyaccel_engine: EngineAdapter | None = None
        self._forward_redirection = _ForwardRedirection()

    # ---------------------------------------------------------------- precision: always the engine's
    @property
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else PolyaccelPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, PolyaccelPrecision):
            plugin = PolyaccelPrecision(_precision_name(plugin))
        self._precision_plugin = plugin

    # ---------------------------------------------------------------- distributed set-up
    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Shard the data over the data axis only: the tensor ranks of one replica see the same batches."""
        rank, size = data_axis(self.config, self.global_rank, self.world_size)
        return {"num_replicas": size, "rank": rank}

    # ---------------------------------------------------------------- sequence parallelism
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """The batch on the device; with sequence parallelism (once the engine exists), this rank's part of every
        sequence (:func:`polyaccel.sequence.split_batch`): the step gets ``input_ids``, global ``position_ids``,
        ``labels``/``shift_labels`` shifted over the whole sequence and ``num_items_in_batch`` (pass them all to
        the model: ``self.lm(**batch).loss``)."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self._sp_size == 1 or self.polyaccel_engine is None:
            return batch
        return split_for_sequence(batch, self._sp_rank, self._sp_size)

    def sequence_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The whole sequence's loss from this rank's share (the sum over the sequence group, detached): what to
        log, e.g. ``self.log("val_loss", self.trainer.strategy.sequence_loss(loss))``. Without sequence
        parallelism, ``loss`` detached."""
        return whole_sequence_loss(loss, self.polyaccel_engine.engine) if self.polyaccel_engine else loss.detach()

    def training_step(self, *args: Any, **kwargs: Any):
        """The module's step; with sequence parallelism the loss Lightning reports (progress bar, ``outputs`` of
        the batch hooks) is the whole sequence's, while backward runs on this rank's share."""
        out = super().training_step(*args, **kwargs)
        if self.polyaccel_engine is None or self._sp_size == 1:
            return out
        engine = self.polyaccel_engine.engine
        if isinstance(out, torch.Tensor):
            return whole_sequence_value(out, engine)
        if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
            return {**out, "loss": whole_sequence_value(out["loss"], engine)}
        return out

    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        env = self.cluster_environment
        os.environ.update({"MASTER_ADDR": env.main_address, "MASTER_PORT": str(env.main_port),
                           "RANK": str(self.global_rank), "WORLD_SIZE": str(self.world_size),
                           "LOCAL_RANK": str(self.local_rank)})
        from polyaccel import comm
        from polyaccel.comm import teardown

        comm.init_distributed(backend=self._process_group_backend, timeout=self._timeout)
        teardown.release_signals()  # Lightning's own SIGTERM/SIGINT handling stays as it is; the group goes at exit
        self._process_group_backend = torch.distributed.get_backend()

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            if self.polyaccel_engine is None:
                self._init_engine(trainer)
            else:
                self.model = _EngineModule(self.lightning_module, self.polyaccel_engine)
        elif self.polyaccel_engine is None:
            self.model_to_device()
        self.setup_precision_plugin()
        self.barrier()

    def _init_engine(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        cfg = copy.deepcopy(self.config)
        source, schedulers, extra, optimizers = None, [], {}, []
        if "optimizer" not in cfg:
            source, optimizers, schedulers, groups = self._module_optimizers(cfg)
            if groups:
                extra["param_groups"] = groups
        # else: the config's optimizer wins over configure_optimizers, as with Lightning's DeepSpeedStrategy
        self._apply_trainer_settings(cfg, trainer)
        self.polyaccel_config = cfg
        engine = polyaccel.initialize(module, config=cfg, engine=self.engine_name, **extra)
        check_data_axis(engine, *data_axis(cfg, self.global_rank, self.world_size))
        self._sp_rank, self._sp_size = sequence_axis(cfg, self.global_rank)
        check_sequence_axis(engine, self._sp_rank, self._sp_size)
        adapter = EngineAdapter(engine)
        self.polyaccel_engine = adapter
        self.model = _EngineModule(module, adapter)
        lr = (cfg["optimizer"]["params"]["lr"] if "params" in cfg["optimizer"] and "lr" in cfg["optimizer"]["params"]
              else engine.get_lr())
        if len(optimizers) == 2:  # Muon and its AdamW: Lightning steps both (manual optimization), the engine once
            pair = _MuonPair(adapter, source, next(o for o in optimizers if o is not source))
            self.optimizers = [_EngineOptimizer(adapter, o, lr, pair=pair) for o in optimizers]
        else:
            self.optimizers = [_EngineOptimizer(adapter, source, lr)]
        self.lr_scheduler_configs = schedulers

    def _module_optimizers(self, cfg: dict) -> tuple[torch.optim.Optimizer, list, list, list[dict]]:
        """Fill ``cfg["optimizer"]`` from configure_optimizers: (the optimizer the engine stands for, all of
        them, their schedulers, the engine's ``param_groups``)."""
        from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

        module = self.lightning_module
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        muon = [o for o in optimizers if isinstance(o, torch.optim.Muon)]
        if muon and len(optimizers) <= 2:
            # Muon over the hidden matrices (with an AdamW for the rest): the engine's one Muon optimizer
            other = next((o for o in optimizers if o is not muon[0]), None)
            cfg["optimizer"], groups = muon_optimizer_config(muon[0], other, module)
            return muon[0], optimizers, schedulers, groups
        if len(optimizers) != 1:
            raise ConfigError("PolyaccelStrategy trains with one optimizer, or torch.optim.Muon with an "
                              f"AdamW; configure_optimizers gave {len(optimizers)} "
                              f"({', '.join(type(o).__name__ for o in optimizers)})")
        source = optimizer_covers_module(optimizers[0], module)
        cfg["optimizer"] = optimizer_config(source)
        return source, optimizers, schedulers, weight_decay_groups(source, module)

    def _apply_trainer_settings(self, cfg: dict, trainer: pl.Trainer) -> None:
        """Gradient clipping and precision from the Trainer where the config says nothing; accumulation is
        Lightning's."""
        if trainer.gradient_clip_val:
            from lightning.pytorch.utilities import GradClipAlgorithmType

            if trainer.gradient_clip_algorithm not in (None, GradClipAlgorithmType.NORM):
                raise ConfigError("PolyaccelStrategy clips by norm only (gradient_clip_algorithm='norm')")
            cfg.setdefault("gradient_clipping", float(trainer.gradient_clip_val))
        kind = self.precision_plugin.kind
        if kind == "bf16":
            cfg.setdefault("bf16", {"enabled": True})
        elif kind == "fp16":
            cfg.setdefault("fp16", {"enabled": True})
        if cfg.get("gradient_accumulation_steps", 1) != 1:
            raise ConfigError("set gradient accumulation with Trainer(accumulate_grad_batches=...), not in "
                              "the engine config: Lightning decides where the optimizer steps")
        cfg["gradient_accumulation_steps"] = 1
        cfg.pop("train_batch_size", None)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        pass  # made by _init_engine from configure_optimizers

    def model_to_device(self) -> None:
        if self.polyaccel_engine is None:
            self.lightning_module.to(self.root_device)

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def teardown(self) -> None:
        if self.polyaccel_engine is not None and isinstance(self.model, _EngineModule):
            self.model = self.lightning_module
        super().teardown()

    # ---------------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights are in the engine's checkpoint (consolidate with polyaccel zero-to-fp32)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The LightningModule's parameters gathered from the engine (a collective in stage 3)."""
        return self.polyaccel_engine.full_state_dict()

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("PolyaccelStrategy writes checkpoints itself; storage_options is not supported")
        filepath = self.broadcast(str(filepath))
        if self.polyaccel_engine is None:
            raise PolyaccelError("PolyaccelStrategy saves checkpoints while fitting (the engine holds the state)")
        data, problem = None, None
        if self.is_global_zero:  # refuse what a resume could not load before the engine writes anything
            state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            state["optimizer_states"] = [opt.state_dict() for opt in self.optimizers]
            data, problem = _serialize_state(state, os.path.join(filepath, LIGHTNING_STATE))
        problem = self.broadcast(problem)
        if problem is not None:
            raise CheckpointError(problem, os.path.join(filepath, LIGHTNING_STATE))
        self.polyaccel_engine.save_checkpoint(filepath, tag=ENGINE_TAG)
        if self.is_global_zero:
            write_bytes(os.path.join(filepath, LIGHTNING_STATE), data)
            # last: the trainer's commit point; the engine's ``latest`` is listed too (the strategy loads its tag by
            # name, so nothing else would notice it damaged)
            names = [LIGHTNING_STATE] + (["latest"] if os.path.isfile(os.path.join(filepath, "latest")) else [])
            write_manifest(filepath, names, trainer="lightning")
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Check the strategy's files against the manifest written at save, load the engine's checkpoint,
        then ``lightning.pt`` with torch's ``weights_only`` loader (nothing in it can run code); any problem
        is a :class:`~polyaccel.errors.CheckpointError` naming the file."""
        path = str(checkpoint_path)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} is not a PolyaccelStrategy checkpoint (not a directory; the strategy "
                                  "writes a folder)", path)
        if self.polyaccel_engine is None:
            raise PolyaccelError("PolyaccelStrategy loads checkpoints into the engine: resume with "
                               "trainer.fit(..., ckpt_path=...)")
        meta = os.path.join(path, LIGHTNING_STATE)
        fix = "resume from another checkpoint"
        verify(path, fix)
        self.polyaccel_engine.load_checkpoint(path, tag=ENGINE_TAG)
        return _load_state(meta, fix)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # the engine loaded the weights in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        for opt, state in zip(self.optimizers, checkpoint.get("optimizer_states", []), strict=False):
            opt.load_state_dict(state)  # the learning rates; the engine loaded its optimizer state

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            import shutil

            shutil.rmtree(filepath, ignore_errors=True)

    @contextmanager
    def block_backward_sync(self):
        yield  # the engine reduces gradients at its own boundaries

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="training through the polyaccel engine")


def register() -> list[str]:
    """Make ``"polyaccel"`` (accelerator and strategy) and every available plugin's name known to Lightning.
    Idempotent; constructing a :class:`PolyaccelStrategy` calls it, importing this module does not. Returns
    the accelerator names registered by this call."""
    names = register_accelerators(AcceleratorRegistry)
    PolyaccelStrategy.register_strategies(StrategyRegistry)
    return names


__all__ = ["ENGINE_TAG", "LIGHTNING_STATE", "PolyaccelAccelerator", "PolyaccelPrecision", "PolyaccelStrategy",
           "accelerator_class", "muon_optimizer_config", "optimizer_config", "register",
           "register_accelerators", "weight_decay_groups"]
