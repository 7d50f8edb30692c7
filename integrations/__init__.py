"""Use polyaccel from the trainers people already run.

Each integration is its own module and imports its framework; none is imported by ``import polyaccel``
or by this package:

- :mod:`polyaccel.integrations.transformers`: ``PolyaccelTrainer`` (Hugging Face ``Trainer`` on the
  polyaccel engine) and ``fused_optimizer`` (``polyaccel.optim`` through ``optimizer_cls_and_kwargs``);
  install ``polyaccel[transformers]``. See docs/integrations-transformers.md.
- :mod:`polyaccel.integrations.lightning`: a Lightning accelerator for the selected polyaccel plugin
  and ``PolyaccelStrategy`` (training through the engine); install ``polyaccel[lightning]``.
  See docs/integrations-lightning.md.
- :mod:`polyaccel.integrations.deepspeed`: the selected polyaccel accelerator and polyaccel's fused
  optimizer ops inside DeepSpeed. See docs/integrations-deepspeed.md.

The integrations reach the engine through :func:`polyaccel.initialize` (entry-point based) only.
"""
