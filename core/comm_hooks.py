"""The comm-hooks contract: what a backend tells ``polyaccel.comm`` about its collectives.

An accelerator gives its own with :meth:`polyaccel.Accelerator.comm_hooks` (the base class
builds them from ``communication_backend``: device tensors go to the backend as they are,
nothing is staged and nothing is emulated); a plugin may override another's through the
``polyaccel_comm_hooks(accelerator)`` hook. :func:`polyaccel.comm.resolve_hooks` decides.

A contract beside :mod:`polyaccel.accelerator`, below the runtime and the comm layer: the
accelerator contract builds its defaults from it, and ``polyaccel.comm`` re-exports it as
``polyaccel.comm.CommHooks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import ConfigError

#: collectives polyaccel.comm can emulate from others, with the emulation used
EMULATIONS = {
    "reduce_scatter_tensor": "all_reduce on a copy of the input, then this rank's slice",
    "all_gather_into_tensor": "all_gather into views of the output",
    "all_to_all_single": "batched isend/irecv of the splits",
}


@dataclass(frozen=True)
class CommHooks:
    """How one backend communicates. Frozen: swap the whole object, never mutate it.

    - ``backend``: the ``torch.distributed`` backend name (``"nccl"``, ``"hccl"``, ``"gloo"`` ...).
    - ``pass_device_id``: give ``init_process_group`` the local device as ``device_id`` (and
      make it current first); lets NCCL-like backends bind eagerly.
    - ``supports_device_tensors``: False for a backend that can only read host memory (gloo
      with mps tensors); the accelerator's tensors are staged through host buffers from it.
    - ``emulated_collectives``: collectives the backend lacks, built from others (see
      :data:`EMULATIONS`) and shown as emulated in ``polyaccel report``.
    """

    backend: str
    pass_device_id: bool = False
    supports_device_tensors: bool = True
    emulated_collectives: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"CommHooks.backend must be a torch.distributed backend name, got {self.backend!r}")
        emulated = frozenset(self.emulated_collectives)
        unknown = sorted(emulated - EMULATIONS.keys())
        if unknown:
            raise ConfigError(
                f"CommHooks.emulated_collectives: cannot emulate {unknown}; emulations exist for {sorted(EMULATIONS)}"
            )
        object.__setattr__(self, "emulated_collectives", emulated)

    @property
    def stages(self) -> bool:
        """Whether any tensor can need host staging under these hooks."""
        return not self.supports_device_tensors

    def needs_staging(self, tensor: torch.Tensor, accelerator) -> bool:
        """Whether ``tensor`` goes through a host buffer: it is ``accelerator``'s and the backend cannot read it."""
        return not self.supports_device_tensors and accelerator.on_accelerator(tensor)

    @classmethod
    def defaults_for(cls, accelerator) -> CommHooks:
        return cls(backend=accelerator.communication_backend,
                   pass_device_id=bool(getattr(accelerator, "comm_binds_device", False)))

    def as_dict(self) -> dict:
        return {
            "backend": self.backend,
            "pass_device_id": self.pass_device_id,
            "supports_device_tensors": self.supports_device_tensors,
            "emulated_collectives": {name: EMULATIONS[name] for name in sorted(self.emulated_collectives)},
        }
