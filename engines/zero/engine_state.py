"""What a :class:`~.engine.ZeroEngine` reports about itself: norms, scales, plans, sizes, parameters.

Views over the engine's attributes (the ``EngineState`` base of the engine; ``set_lr`` is its one
setter), kept apart from the set-up and the training loop; see :mod:`polyaccel.engines.zero` for
the contract.
"""

from __future__ import annotations

import math

import torch
from polyaccel.parallel import get_plan


class EngineState:
    """The inspection API of :class:`~.engine.ZeroEngine` (it sets every attribute these read)."""

    @property
    def offload_optimizer(self) -> bool:
        """Whether the master partitions and the optimizer step live on the host (``offload_optimizer``)."""
        return self.placement.optimizer.on_host

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer boundary (before clipping; ``inf`` when fp16
        overflowed and the step was skipped), or None before the first."""
        return self.last_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last :meth:`step` applied the optimizer (False between boundaries and on a skipped
        step)."""
        return self._last_step_applied

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer boundary (see :meth:`get_global_grad_norm`). Kept on
        the device when the step did not need it; reading it then waits for that step's backward."""
        if isinstance(self._grad_norm, torch.Tensor):
            self._grad_norm = math.sqrt(float(self._grad_norm.item()))
        return self._grad_norm


    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def optimizer_builder(self) -> str:
        return self.optimizer.builder_name

    @property
    def tp_plan(self):
        """The tensor-parallel plan a model layer applied (None without one)."""
        return get_plan(self.module, "tensor")

    @property
    def ep_plan(self):
        """The expert-parallel plan a model layer applied (None without one)."""
        return get_plan(self.module, "expert")

    def get_lr(self) -> float:
        return self.optimizer.lr

    def set_lr(self, lr: float) -> None:
        for g in self.groups:
            g.optimizer.lr = float(lr)

    @property
    def host_optimizer_share(self) -> float:
        """The share of this rank's master elements whose optimizer step runs on the host: 0 without
        ``offload_optimizer``, 1 with it, in between with ``offload_optimizer.ratio`` below 1 (the ratio
        rounded to whole buckets, or whole parameters in stage 3)."""
        return self.placement.optimizer.host_share([g.partitioner.master for g in self.groups])

    def optimizer_state_elements(self) -> int:
        """Elements of optimizer state (master copy + moments) this rank holds."""
        return sum(g.partitioner.master.numel() + g.optimizer.state_elements() for g in self.groups)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter (gathered over its partition group, compute dtype) by name: a collective in stage
        3. A parameter split over tensor or expert ranks appears as this rank's piece."""
        full = {}
        for g in self.groups:
            full.update(g.partitioner.full_params())
        for name, p in self.frozen:
            if name not in full:
                full[name] = p.detach().clone()
        return full
