"""polyaccel in the Hugging Face ``Trainer``: the fused optimizers, or the whole engine.

Two ways in (install ``polyaccel[transformers]``; see docs/integrations-transformers.md):

1. **Optimizer path** — keep ``Trainer`` as it is (DDP, Accelerate, its clipping and scheduler)
   and step with a :mod:`polyaccel.optim` optimizer, which runs the ``fused_adam`` / ``fused_lion`` /
   ``fused_lamb`` op of the selected plugin::

       trainer = Trainer(model, args, train_dataset=ds,
                         optimizer_cls_and_kwargs=fused_optimizer(args))         # FusedAdam from args

2. **Engine path** — :class:`PolyaccelTrainer` trains through :func:`polyaccel.initialize` (ZeRO
   stages 1-3, offload, and AutoTP/AutoEP when the config names them)::

       trainer = PolyaccelTrainer(model, args, train_dataset=ds,
                                  polyaccel_config={"zero_optimization": {"stage": 3}})
       trainer.train()                      # resume_from_checkpoint=... works as usual

   The engine owns the optimizer (``optimizer`` section of the config, filled from the
   ``TrainingArguments`` where absent or ``"auto"``) and applies the Trainer's learning-rate
   scheduler each step; Accelerate only shards the data. Checkpoints are HF checkpoints
   (``model.safetensors`` with the full weights, ``scheduler.pt``, ``trainer_state.json``, RNG
   states) plus the engine's sharded checkpoint in ``<checkpoint>/polyaccel`` and
   ``polyaccel-files.json``, the checksums of the Trainer's files, checked before a resume reads any.
"""

from __future__ import annotations

import copy
import os

import polyaccel
import torch
import transformers
from accelerate.optimizer import AcceleratedOptimizer
from polyaccel.errors import CheckpointError, ConfigError
from polyaccel.safe_files import write_atomic

from ._checkpoint_files import MANIFEST, load_refusal, verify, write_manifest
from ._engine import EngineAdapter, check_data_axis, data_axis, sequence_axis
from ._sequence import check_sequence_axis, split_for_sequence, whole_sequence_loss

#: folder inside an HF checkpoint that holds the engine's sharded checkpoint
ENGINE_CHECKPOINT_DIR = "polyaccel"
SCHEDULER_NAME = "scheduler.pt"

_OPTIMIZERS = {
    "adamw": ("FusedAdam", True), "adam": ("FusedAdam", False),
    "lion": ("FusedLion", None), "lamb": ("FusedLamb", None),
}


def fused_optimizer(args: transformers.TrainingArguments | None = None, name: str = "adamw", **overrides):
    """``(optimizer_cls, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``: a polyaccel fused optimizer.

    ``name``: ``adamw`` (FusedAdam, decoupled weight decay), ``adam`` (FusedAdam, L2), ``lion`` or
    ``lamb``. The learning rate, betas, epsilon and weight decay come from ``args`` (Trainer's own
    weight-decay groups still apply: biases and norms get none); ``overrides`` win.
    """
    try:
        cls_name, adam_w_mode = _OPTIMIZERS[name]
    except KeyError:
        raise ConfigError(f"unknown polyaccel optimizer {name!r}; choose one of {sorted(_OPTIMIZERS)}") from None
    cls = getattr(polyaccel.optim, cls_name)
    kwargs: dict = {}
    if args is not None:
        kwargs = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                  "weight_decay": args.weight_decay}
        if cls_name != "FusedLion":
            kwargs["eps"] = args.adam_epsilon
    if adam_w_mode is not None:
        kwargs["adam_w_mode"] = adam_w_mode
    kwargs.update(overrides)
    return cls, kwargs


def engine_config(args: transformers.TrainingArguments, config: dict | None = None) -> dict:
    """The engine config for ``args``: ``config`` (DeepSpeed-style keys) completed from the Trainer's arguments.

    Keys that are absent or ``"auto"`` are taken from ``args``: the micro-batch size, gradient
    accumulation, clipping (``max_grad_norm``), ``bf16`` and the optimizer's settings the Trainer has under
    their own names (learning rate and weight decay for every type; betas and epsilon for Adam, AdamW and LAMB,
    betas for Lion; Muon's Newton-Schulz ``eps`` and its AdamW's ``adam_*`` keys come from the config alone).
    The micro-batch size and accumulation steps must agree with ``args`` when given: the Trainer drives both.
    """
    cfg = copy.deepcopy(config) if config else {}
    if not isinstance(cfg, dict):
        raise ConfigError(f"polyaccel_config must be a dict, got {type(cfg).__name__}")

    def fill(section: dict, key: str, value, must_match: bool = False):
        if section.get(key, "auto") == "auto":
            section[key] = value
        elif must_match and section[key] != value:
            raise ConfigError(f"polyaccel_config key {key!r} is {section[key]!r} but the TrainingArguments say "
                              f"{value!r}; the Trainer drives this: set it in the TrainingArguments or to 'auto'")

    fill(cfg, "train_micro_batch_size_per_gpu", args.per_device_train_batch_size, must_match=True)
    fill(cfg, "gradient_accumulation_steps", args.gradient_accumulation_steps, must_match=True)
    if cfg.get("train_batch_size") == "auto":
        del cfg["train_batch_size"]
    fill(cfg, "gradient_clipping", float(args.max_grad_norm or 0.0))
    if args.fp16:
        raise ConfigError("TrainingArguments(fp16=True) is Accelerate's loss scaling, which cannot see the engine's "
                          "partitioned gradients; leave fp16 off there and set polyaccel_config['fp16'] = "
                          "{'enabled': True} (the engine scales the loss itself)")
    if args.bf16:
        bf16 = cfg.setdefault("bf16", {})
        fill(bf16, "enabled", True)
    opt = cfg.setdefault("optimizer", {})
    fill(opt, "type", "adamw")
    params = opt.setdefault("params", {})
    taken = _TRAINER_FILLS.get(str(opt["type"]).lower(), ("lr", "weight_decay"))
    for key, value in (("lr", args.learning_rate), ("betas", [args.adam_beta1, args.adam_beta2]),
                       ("eps", args.adam_epsilon), ("weight_decay", args.weight_decay)):
        if key in taken:
            fill(params, key, value)
    return cfg


#: which TrainingArguments each optimizer type takes from the Trainer (lr, betas from adam_beta1/2, eps from
#: adam_epsilon, weight_decay): only the settings it has under that name. Muon's ``eps`` is Newton-Schulz's, not
#: Adam's, and its auxiliary AdamW has its own ``adam_betas`` / ``adam_eps`` (set them in the config): the Trainer
#: gives it the lr its scheduler drives and the weight decay only.
_TRAINER_FILLS = {
    "adam": ("lr", "betas", "eps", "weight_decay"), "adamw": ("lr", "betas", "eps", "weight_decay"),
    "lamb": ("lr", "betas", "eps", "weight_decay"), "lion": ("lr", "betas", "weight_decay"),
    "muon": ("lr", "weight_decay"),
}


_RESUME_FIX = "resume from another checkpoint (or train from scratch)"


#: the Trainer methods the engine path overrides; their absence means a Trainer this path was not written for
_TRAINER_HOOKS = ("_wrap_model", "_clip_grad_norm", "_get_grad_norm", "_maybe_log_save_evaluate",
                  "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "_load_from_checkpoint",
                  "_save_scaler", "create_optimizer", "training_step", "_save_checkpoint", "_load_rng_state",
                  "_get_output_dir", "get_decay_parameter_names")


class _LRDriver(torch.optim.Optimizer):
    """The ``optimizer`` the Trainer and its scheduler see: one param group whose ``lr`` the scheduler
    sets; :meth:`step` hands that lr to the engine and runs the engine's optimizer step."""

    def __init__(self, adapter: EngineAdapter):
        self._adapter = adapter
        super().__init__([torch.zeros(0)], {"lr": adapter.engine.get_lr()})
        self.last_step_applied = False
        #: the last step was skipped (the engine's fp16 overflow): nothing applied
        self.last_step_skipped = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._adapter.engine.set_lr(self.param_groups[0]["lr"])
        self.last_step_applied = self._adapter.step(boundary=True)
        self.last_step_skipped = bool(getattr(self._adapter.engine, "last_step_skipped", False))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:  # the engine zeroes its gradients at each step
        pass


class _SkipAwareOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper around the :class:`_LRDriver`, reporting the engine's skipped steps.

    The Trainer advances its LR scheduler only when ``accelerator.optimizer_step_was_skipped`` is false, which asks
    each prepared optimizer's ``step_was_skipped``: Accelerate's own wrapper knows only its GradScaler's overflow
    (DeepSpeed's wrapper asks the engine). This one says what the engine did, so an fp16 overflow leaves the
    scheduler where it was, as on the DeepSpeed path. Made already prepared: ``accelerator.prepare`` keeps it."""

    def __init__(self, driver: _LRDriver):
        super().__init__(driver, device_placement=False, scaler=None)
        self._is_accelerate_prepared = True

    @property
    def step_was_skipped(self) -> bool:
        return self.optimizer.last_step_skipped


class _EngineModel(torch.nn.Module):
    """What the Trainer calls ``model`` on the engine path: forward through the engine; not a module
    Accelerate knows, so it neither wraps it in DDP nor moves it."""

    def __init__(self, model: torch.nn.Module, adapter: EngineAdapter):
        super().__init__()
        self.module = model
        self.adapter = adapter

    def forward(self, *args, **kwargs):
        return self.adapter.engine(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adapter.engine.zero_grad()


def shard_over_data_axis(accelerator, rank: int, size: int) -> None:
    """Make ``accelerator.prepare`` shard data loaders over the ``size`` data-parallel ranks (this process is data
    rank ``rank``) instead of over every process: the tensor ranks of one model replica get the same batches.

    Everything else is the accelerator's own preparation (seedable sampler, RNG synchronisation, even batches,
    device placement). Dispatching batches from the main process is refused: it splits one batch over every process.
    """
    from accelerate.data_loader import prepare_data_loader

    def prepare(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in accelerator._dataloaders:
                accelerator._dataloaders.append(data_loader)
            return data_loader
        if accelerator.dispatch_batches:
            raise ConfigError("accelerator_config dispatch_batches=True splits the main process's batches over every "
                              "process, but the tensor ranks of one replica need the same batch: set "
                              "TrainingArguments(accelerator_config={'dispatch_batches': False})")
        prepared = prepare_data_loader(
            data_loader, accelerator.device, num_processes=size, process_index=rank,
            split_batches=accelerator.split_batches,
            put_on_device=accelerator.device_placement if device_placement is None else device_placement,
            rng_types=accelerator.rng_types.copy(), dispatch_batches=False, even_batches=accelerator.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed, non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader)
        accelerator._dataloaders.append(prepared)
        return prepared

    accelerator.prepare_data_loader = prepare


class PolyaccelTrainer(transformers.Trainer):
    """``transformers.Trainer`` that trains through the polyaccel engine (default: ZeRO).

    Extra arguments: ``polyaccel_config`` (the engine config, DeepSpeed-style; completed by
    :func:`engine_config`) and ``engine`` (entry-point name in ``polyaccel.engines``). After the
    first ``train()``, ``trainer.polyaccel_engine`` is the engine (an :class:`EngineAdapter`) and
    ``trainer.polyaccel_config`` the config it got.

    Not supported on this path: a user-supplied optimizer (the engine owns it: configure it in
    ``polyaccel_config['optimizer']``), ``TrainingArguments(fp16=True)`` (use the config's ``fp16``),
    and Accelerate's DeepSpeed/FSDP plugins. Weight decay is the Trainer's split: the parameters
    :meth:`get_decay_parameter_names` leaves out (biases, norms) get none, the others the config's
    ``optimizer.params.weight_decay`` (``TrainingArguments.weight_decay`` unless the config sets it). A step the
    engine skips (fp16 overflow) leaves the LR scheduler where it was.
    """

    def __init__(self, *args, polyaccel_config: dict | None = None, engine: str = "zero", **kwargs):
        missing = [h for h in _TRAINER_HOOKS if not hasattr(transformers.Trainer, h)]
        if missing:
            raise ImportError(f"PolyaccelTrainer needs a transformers Trainer with {', '.join(missing)} "
                              f"(transformers 5.x); this is transformers {transformers.__version__}")
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers[0] is not None or kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ConfigError("PolyaccelTrainer: the engine owns the optimizer; configure it in "
                              "polyaccel_config['optimizer'] instead of passing optimizers/optimizer_cls_and_kwargs")
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ConfigError("PolyaccelTrainer replaces Accelerate's DeepSpeed/FSDP: remove them from the "
                              "TrainingArguments")
        self.polyaccel_config = engine_config(self.args, polyaccel_config)
        self._polyaccel_engine_name = engine
        self.polyaccel_engine: EngineAdapter | None = None
        self._engine_model: _EngineModel | None = None
        # with tensor parallelism the data is sharded over the data axis only (the engine's mesh is built later,
        # in create_optimizer, from the same config and world)
        world = self.args.world_size
        self._data_rank, self._data_size = data_axis(self.polyaccel_config, self.args.process_index, world)
        if self._data_size != world:
            shard_over_data_axis(self.accelerator, self._data_rank, self._data_size)
        # with sequence parallelism each rank feeds its part of every sequence (training_step)
        self._sp_rank, self._sp_size = sequence_axis(self.polyaccel_config, self.args.process_index)
        if self._sp_size > 1:
            self._check_sequence_parallel()

    # ------------------------------------------------------------------ set-up
    def create_optimizer(self, model=None):
        if self.optimizer is None:
            extra = {}
            groups = self.weight_decay_groups()
            if groups:
                extra["param_groups"] = groups
            engine = polyaccel.initialize(self.model, config=self.polyaccel_config, engine=self._polyaccel_engine_name,
                                          **extra)
            check_data_axis(engine, self._data_rank, self._data_size)
            check_sequence_axis(engine, self._sp_rank, self._sp_size)
            self.polyaccel_engine = EngineAdapter(engine)
            self._engine_model = _EngineModel(self.model, self.polyaccel_engine)
            self.optimizer = _SkipAwareOptimizer(_LRDriver(self.polyaccel_engine))
        return self.optimizer

    def weight_decay_groups(self) -> list[dict]:
        """The engine's ``param_groups``: the trainable parameters the stock ``create_optimizer`` puts in its
        no-decay group (not in :meth:`get_decay_parameter_names`), by name, with weight decay 0; the rest keep
        the config's. Empty when every parameter decays."""
        decay = set(self.get_decay_parameter_names(self.model))
        no_decay = [n for n, p in self.model.named_parameters() if p.requires_grad and n not in decay]
        return [{"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}] if no_decay else []

    def get_tp_size(self) -> int:
        """The processes that share one batch (the engine's tensor and sequence ranks): the Trainer divides its
        token counts and batch sizes by it."""
        return self.args.world_size // self._data_size

    def _check_sequence_parallel(self) -> None:
        """What the loss of a sequence split over ranks needs from the Trainer: the model's loss divided by the
        token count of the whole batch (the Trainer's ``num_items_in_batch``, counted over every rank)."""
        what = f"polyaccel_config['sequence_parallel'] (sequence size {self._sp_size})"
        if not self.model_accepts_loss_kwargs:
            raise ConfigError(f"{what}: the model's forward must take loss keyword arguments (shift_labels, "
                              f"num_items_in_batch) so that each rank's loss is its share of the whole sequence's; "
                              f"{type(self.model).__name__}.forward takes no **kwargs")
        if not self.args.average_tokens_across_devices:
            raise ConfigError(f"{what} needs TrainingArguments(average_tokens_across_devices=True): each rank's loss "
                              "is divided by the tokens of the whole batch, counted over every rank")
        if self.label_smoother is not None or self.compute_loss_func is not None:
            raise ConfigError(f"{what}: label smoothing and compute_loss_func see the labels already shifted over "
                              "the whole sequence and cut to this rank's part; drop label_smoothing_factor / "
                              "compute_loss_func (the model computes the loss)")

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self._engine_model is not None:
            return self._engine_model
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    # ------------------------------------------------------------------ training
    def _prepare_input(self, data):
        data = super()._prepare_input(data)
        if self.polyaccel_engine is not None and isinstance(data, torch.Tensor):
            data = data.to(self.polyaccel_engine.device)
        return data

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.polyaccel_engine is None:
            return super().training_step(model, inputs, num_items_in_batch)
        adapter = self.polyaccel_engine
        model.train()
        inputs = self._prepare_inputs(inputs)
        if self._sp_size > 1:  # this rank's part of every sequence; the Trainer's token count (whole batch) wins
            inputs = split_for_sequence(inputs, self._sp_rank, self._sp_size)
            if num_items_in_batch is not None:
                inputs.pop("num_items_in_batch", None)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if self.args.n_gpu > 1:
            loss = loss.mean()
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) \
                or getattr(self, "compute_loss_func", None) is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        # the engine divides by its accumulation steps: hand it the Trainer's loss times them
        adapter.backward(loss * adapter.gradient_accumulation_steps)
        if not self.accelerator.sync_gradients:
            adapter.step(boundary=False)  # count the micro-step; the Trainer steps the optimizer at the boundary
        # the loss logged is the whole sequence's: the sum of the sequence ranks' shares
        return whole_sequence_loss(loss, adapter.engine) if self._sp_size > 1 else loss.detach()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """With sequence parallelism, the loss only: each rank's share of the batch's loss, summed over the sequence
        group (the logits stay cut over the sequence ranks, so predictions and compute_metrics are refused)."""
        if self.polyaccel_engine is None or self._sp_size == 1:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if not prediction_loss_only:
            raise ConfigError(
                f"PolyaccelTrainer with sequence_parallel (sequence size {self._sp_size}) evaluates the loss only: the "
                "logits are cut over the sequence ranks, so predict() and compute_metrics cannot have them; drop "
                "compute_metrics (or set prediction_loss_only=True), or run predictions on the consolidated model "
                "(trainer.save_model, or polyaccel zero-to-fp32) with a plain Trainer")
        inputs = self._prepare_inputs(inputs)
        if "labels" not in inputs and "shift_labels" not in inputs:
            return None, None, None
        part = split_for_sequence(inputs, self._sp_rank, self._sp_size)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = model(**part).loss  # this rank's tokens' loss over the whole batch's token count
        return whole_sequence_loss(loss, self.polyaccel_engine.engine), None, None

    def _clip_grad_norm(self, model):
        return None  # the engine clips inside its step (gradient_clipping)

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # known only after the engine's step: see _maybe_log_save_evaluate

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        if self.polyaccel_engine is not None and grad_norm is None:
            grad_norm = self.polyaccel_engine.get_global_grad_norm()
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def _full_state_dict(self) -> dict:
        """The model's state dict with every parameter gathered from the engine (collective in stage 3)."""
        engine = self.polyaccel_engine.engine
        params = engine.full_state_dict()
        state = {k: v for k, v in self.model.state_dict().items() if k not in params}
        state.update(params)
        for alias, name in getattr(engine, "aliases", {}).items():
            if name in params:
                state[alias] = params[name]
        return state

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.polyaccel_engine is None:
            return super().save_model(output_dir, _internal_call)
        state = self._full_state_dict()  # every rank: a collective in stage 3
        self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """``Trainer.train``; a checkpoint to resume from is checked first (every file against the manifest
        written at save), so a damaged one is refused naming the file before the Trainer reads any of it."""
        ckpt = resume_from_checkpoint
        if isinstance(ckpt, bool) and ckpt:
            from transformers.trainer_utils import get_last_checkpoint

            ckpt = get_last_checkpoint(self.args.output_dir)  # None: the Trainer reports it
        if isinstance(ckpt, (str, os.PathLike)):
            if not os.path.isdir(ckpt):
                raise CheckpointError(f"resume_from_checkpoint {ckpt}: no such checkpoint folder", ckpt)
            verify(ckpt, _RESUME_FIX)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.polyaccel_engine is None:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.accelerator.wait_for_everyone()  # every rank's files (rng_state_<rank>.pth) are written
        if self.args.should_save and os.path.isdir(folder):
            names = [n for n in os.listdir(folder) if not n.startswith(".") and n != MANIFEST
                     and os.path.isfile(os.path.join(folder, n))]
            write_manifest(folder, names, trainer="transformers")  # last: the trainer's commit point
        self.accelerator.wait_for_everyone()

    def _load_rng_state(self, checkpoint) -> None:
        try:
            return super()._load_rng_state(checkpoint)
        except Exception as exc:  # noqa: BLE001 - HF loads with weights_only=True: a refusal is a bad file
            name = f"rng_state_{self.args.process_index}.pth" if self.args.world_size > 1 else "rng_state.pth"
            path = os.path.join(checkpoint, name)
            raise CheckpointError(f"{path}: cannot be loaded safely ({load_refusal(exc)}); {_RESUME_FIX}",
                                  path) from None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.polyaccel_engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.polyaccel_engine.save_checkpoint(os.path.join(output_dir, ENGINE_CHECKPOINT_DIR))
        if self.args.should_save:
            state = self.lr_scheduler.state_dict()
            write_atomic(os.path.join(output_dir, SCHEDULER_NAME), lambda tmp: torch.save(state, tmp))

    def _save_scaler(self, output_dir: str) -> None:
        if self.polyaccel_engine is None:
            return super()._save_scaler(output_dir)
        # the engine's fp16 loss scale is part of its checkpoint

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self.polyaccel_engine is not None:
            return  # the engine's checkpoint holds the weights (_load_optimizer_and_scheduler)
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.polyaccel_engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        engine_dir = os.path.join(checkpoint, ENGINE_CHECKPOINT_DIR)
        if not os.path.isdir(engine_dir):
            raise FileNotFoundError(f"{checkpoint} has no polyaccel engine checkpoint ({ENGINE_CHECKPOINT_DIR}/); "
                                    "it was not written by PolyaccelTrainer")
        self.polyaccel_engine.load_checkpoint(engine_dir)
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if not os.path.isfile(sched):
            raise CheckpointError(f"{sched}: missing; {_RESUME_FIX}", sched)
        try:
            state = torch.load(sched, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - unreadable or refused: never unpickled beyond weights_only
            raise CheckpointError(f"{sched}: cannot be loaded safely ({load_refusal(exc)}); {_RESUME_FIX}",
                                  sched) from None
        self.lr_scheduler.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr(), strict=False):
            group["lr"] = lr


__all__ = ["ENGINE_CHECKPOINT_DIR", "EngineAdapter", "PolyaccelTrainer", "engine_config", "fused_optimizer",
           "shard_over_data_axis"]
