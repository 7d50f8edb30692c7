"""ZeRO data-parallel training engine (stages 1-3, CPU offload, mixed precision, sharded checkpoints).

The engine talks to hardware only through polyaccel's contracts: the selected accelerator
(device, streams when it claims ``streams``, ``is_synchronized_device``, host buffers through
``empty_pinned`` / ``register_host_memory``), the op registry for the optimizer step
(``fused_adam`` / ``fused_lion`` / ``fused_lamb`` for the device type where the fp32 partition
lives: ``cpu`` when offloaded), and ``polyaccel.comm`` for every collective. So it runs
unchanged on any installed plugin.

Contract (entry point ``zero`` in the ``polyaccel.engines`` group)
------------------------------------------------------------------
``polyaccel.initialize(model, config=dict, param_groups=None) -> engine``. Initialises ``polyaccel.comm``
when no process group exists (from torchrun's environment, else as a world of one) and moves the
model to the accelerator (cast to bf16/fp16 when enabled).

``param_groups`` (optional): a weight decay per parameter group, in torch's shape,
``[{"params": [...], "weight_decay": 0.0, "name": "no_decay"}, ...]``. ``params`` holds the model's
parameters or their names (``model.named_parameters()``'s; names survive a model layer that replaces
tensors). Parameters in no group, and groups without ``weight_decay``, take the config's
``optimizer.params.weight_decay``. Only ``params``, ``weight_decay`` and ``name`` are accepted; an unknown
parameter, one in two groups, a negative or non-finite decay or any other key is refused with a
:class:`~polyaccel.errors.ConfigError` before the model is touched; the caller's lists are only read. All
optimizer types apply it (LAMB adds each run's decay to its update before the trust ratio). The partitions
and the checkpoint format do not change: the step runs one op call per distinct decay over the contiguous
runs of the partition that share it (see :mod:`.weight_decay`), one call without groups.
``engine.weight_decays`` is ``{name: decay}`` for the trainable parameters a group named. The engine has:

- ``engine(*args, **kw)`` / ``engine.forward(*args, **kw)``: the wrapped module's forward
  (stage 3 gathers parameters around each submodule's forward and backward).
- ``engine.backward(loss)``: backward of ``loss / gradient_accumulation_steps`` (times the
  fp16 loss scale); stage 2/3 reduce-scatter gradients during it (stage 1 too at one
  micro-step per boundary: there is nothing to accumulate).
- ``engine.step() -> bool``: counts a micro-step; at an accumulation boundary it reduces
  (stage 1), unscales, checks fp16 overflow (a skipped step returns False and lowers the
  scale), clips to ``gradient_clipping``, applies the optimizer, republishes parameters and
  zeroes gradients. Returns True when the optimizer was applied.
  ``engine.step(boundary=True|False)``: a trainer that decides where its accumulation windows end
  (Accelerate, Lightning) says so: True steps now (a short last window), False only counts.
- For trainers: ``engine.get_global_grad_norm()`` (the last boundary's norm before clipping,
  ``inf`` when it was skipped, None before the first; without clipping or fp16 the step itself never
  waits for the device, so the norm is read, and the host waits for that step's backward, only when
  asked for), ``engine.was_step_applied()`` and
  ``engine.last_step_skipped`` (the last boundary overflowed in fp16: nothing applied).
- ``engine.zero_grad()``, ``engine.train(mode=True)`` / ``engine.eval()`` (the module's mode).
- ``engine.save_checkpoint(dir, tag=None, client_state=None) -> tag`` (collective; default tag
  ``global_step{N}``; ``client_state`` must be JSON-serialisable) and
  ``engine.load_checkpoint(dir, tag=None) -> client_state`` (tag None: the one in ``latest``;
  any world size and stage can load any checkpoint).
- ``engine.groups``: the partition groups (one without a mesh); ``engine.partitioner`` and
  ``engine.optimizer`` are the first one's.
- ``engine.module``, ``engine.global_steps`` (optimizer boundaries, skipped ones included),
  ``engine.micro_steps``, ``engine.skipped_steps``, ``engine.loss_scale`` (1.0 without fp16),
  ``engine.optimizer_builder`` (name of the op builder the registry chose),
  ``engine.last_grad_norm``, ``engine.get_lr()`` / ``engine.set_lr(lr)``,
  ``engine.full_state_dict()`` (gathered parameters; collective in stage 3),
  ``engine.optimizer_state_elements()``, ``engine.destroy()``.
- ``engine.checkpoint(fn, *args, **kw)``: activation checkpointing as the config's
  ``activation_checkpointing`` section says (see :mod:`.activation_checkpoint`); with the section
  present, Hugging Face models get it through their own checkpointing switch.

Over a mesh (``mesh=``, given by ``polyaccel.initialize`` when the config turns on a model layer
such as ``tensor_parallel`` or ``expert_parallel``), every trainable parameter's
:class:`polyaccel.parallel.ParamLayout` decides where it goes: parameters that share a layout
kind share one partition, over the ``data`` or ``expert_data`` group their layout names;
gradients are averaged over every data-parallel rank; ``grad_sum`` parameters are summed over
the tensor ranks; the gradient norm counts each element once (a parameter split over tensor or
expert ranks piece by piece, a replicated one once). Checkpoints then record, per rank, each
partition group and each parameter's split, and load into any other layout the model allows.

Config (DeepSpeed's key names; unknown keys are rejected, the caller's dict is never modified):
``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
``gradient_clipping``, ``bf16.enabled``, ``fp16.{enabled, loss_scale, initial_scale_power,
loss_scale_window, hysteresis, min_loss_scale}``, ``optimizer.{type: adam|adamw|lion|lamb,
params: {lr, betas, eps, weight_decay, adam_w_mode, bias_correction, max_coeff, min_coeff}}``,
``zero_optimization.{stage: 1|2|3, reduce_bucket_size, overlap_comm, contiguous_gradients,
stage3_prefetch_bucket_size, stage3_param_persistence_threshold, stage3_leaf_modules: [class
name or module path, ...], stage3_check_schedule: bool, offload_optimizer: {device:
none|cpu, pin_memory, overlap_step, ratio (not with offload_param)}, offload_param: {device:
none|cpu, pin_memory} (stage 3)}``,
``activation_checkpointing.{cpu_checkpointing, synchronize_checkpoint_boundary,
number_checkpoints}`` (``partition_activations``, ``contiguous_memory_optimization`` and
``profile`` are refused when true: not implemented).

Offload: gradients leave the device in the master dtype, converted on the device (a copy that
changes dtype across devices leaves the fast DMA path), straight into the pinned fp32 partition
the first time in an accumulation window; their squared norm is taken on the device on the way,
so the host never reduces the whole partition. The host optimizer then steps bucket by bucket,
and each bucket's 16-bit result is uploaded while the host steps the next (during backward, where
nothing needs the whole gradient first: ``overlap_step``, see :mod:`.host_step`).
``offload_optimizer.ratio`` (default 1) is the share of each partition whose master, moments,
gradient and step live on the host; the rest stays on the device: the buckets whose gradients
arrive last in backward, whose host step could not hide under backward and which the next
forward needs first (:mod:`.split_partition`; rounded to whole buckets in stages 1 and 2, to whole
parameters in stage 3, with a warning where that lands far from the ratio; element-wise optimizers,
parameters not offloaded). It trades device memory (about 14 bytes per parameter kept there, 16 in
stage 3) for the host's step time and the bus; a checkpoint does not depend on it.
With ``offload_param`` (stage 3) each rank's parameter shards live in one registered host buffer;
a gather copies them up on a copy stream of their own, which the compute stream waits for only
where the module runs, so the copies of prefetched modules run beside the kernels before them
(:meth:`.offload.HostTransfer.upload_shards`).

Invariant: every rank issues the same collectives in the same order, whatever its local
gradients and control flow. Ranks may disagree about which parameters got a gradient (an MoE
expert that got no token on this rank, a data-dependent branch): gradient buckets are
reduced in bucket order, early only as a prefix of that order, and the rest after backward
(:mod:`.bucket_order`). In stage 3 a module that runs on some ranks only would make the
parameter gathers differ: mark the module around it as a leaf (gathered as a whole; modules
holding per-expert modules are leaves automatically, see :mod:`.leaves`), and before each
gather, and at the end of each forward and backward, the ranks check that they agree
(``stage3_check_schedule``, default true: one small all-gather each, see :mod:`.schedule`),
so an unmarked one makes every rank fail at once with :class:`ScheduleMismatch` naming the
module and the fix instead of a mismatched or never-answered collective (docs/zero-stage3.md).
As in DeepSpeed, optimizer type ``adam`` uses decoupled weight decay unless ``adam_w_mode`` is false.

Without bf16/fp16 the model keeps its dtype; a float64 model trains with float64 master
weights (used by the tests to check exactness). Gradients are reduced in the model's compute
dtype (pre-divided by the world size), as DeepSpeed does by default; the master weights,
moments and gradient partition are fp32. Parameters that get no gradient in a step are
treated as having a zero gradient (Adam's weight decay still applies to them).

Partition sizes: stages 1 and 2 hold exactly ``ceil(total / world)`` elements of master weights
and of each moment per rank (:class:`~.partition.FlatLayout`); stage 3 partitions each parameter
on its own and holds ``sum(ceil(numel_i / world))`` (at most one element per parameter more).
In stage 3, ``param.data`` is empty outside the forward/backward of the module using it; use
``engine.full_state_dict()`` to read the weights.
"""

from __future__ import annotations

from .checkpoint import raise_if_any_failed, run_id
from .config import ZeroConfig, parse_config
from .consolidate import complete_tags, read_latest, read_meta, resolve_tag
from .engine import ZeroEngine
from .leaves import ScheduleMismatch, set_leaf_modules


def initialize(model, config=None, **kwargs) -> ZeroEngine:
    """Wrap ``model`` in a :class:`ZeroEngine` configured by ``config`` (a DeepSpeed-style dict)."""
    return ZeroEngine(model, config, **kwargs)


initialize.CONFIG_KEYS = ZeroEngine.CONFIG_KEYS  # what polyaccel.initialize checks a config's top level against


# what apps/ (``polyaccel train``) reads of a checkpoint besides the engine: its tags, its meta.json, the
# run id a save writes into it, and the collective that turns one rank's failure into every rank's error
__all__ = ["ScheduleMismatch", "ZeroConfig", "ZeroEngine", "complete_tags", "initialize", "parse_config",
           "raise_if_any_failed", "read_latest", "read_meta", "resolve_tag", "run_id", "set_leaf_modules"]
