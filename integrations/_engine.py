"""What trainers expect of an engine beyond polyaccel's engine contract
(:class:`polyaccel.contracts.TrainingEngine`), as an adapter.

Hugging Face Accelerate and Lightning drive an engine DeepSpeed-style: the trainer decides where the
gradient-accumulation boundary is (``set_gradient_accumulation_boundary``), asks for the global
gradient norm of the last step (``get_global_grad_norm``), and may end an epoch on a partial
accumulation window. The engine has that API itself (``step(boundary=...)``, ``get_global_grad_norm()``,
``was_step_applied()`` and ``last_step_skipped`` for an fp16 overflow; see :mod:`polyaccel.engines.zero`);
:class:`EngineAdapter` keeps the boundary a trainer announces with ``set_gradient_accumulation_boundary`` until
the next step, and :func:`data_axis` says how a trainer shards its data over the engine's mesh.
"""

from __future__ import annotations

from ..errors import ConfigError, PolyaccelError


def data_axis(config, rank: int, world: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of global ``rank`` in a world of ``world`` processes for the
    model layers ``config`` names, known before the engine (and its mesh) exists.

    A trainer shards its data over these, never over every rank: the ranks of one tensor group hold pieces of
    one model replica and must see the same batch. The mesh is ``(expert_data, expert, tensor)``, row-major, and
    ``data`` is the flattened ``(expert_data, expert)`` (docs/engine-layers.md): expert parallelism is carved out
    of data parallelism, so expert ranks see different batches, and the data rank is ``rank // tensor``.
    """
    from ..engine_entry import launch_command, layer_mesh_sizes

    sizes = layer_mesh_sizes(config)
    tensor, expert = sizes.get("tensor", 1), sizes.get("expert", 1)
    if world % tensor or (world // tensor) % expert:
        n = tensor * expert
        raise ConfigError(f"tensor {tensor} x expert {expert} (the config's tensor_parallel and expert_parallel) needs "
                          f"a multiple of {n} processes, one per device, but this run has {world}: start it with "
                          f"`{launch_command(n)}`")
    return rank // tensor, world // tensor


def check_data_axis(engine, rank: int, size: int) -> None:
    """The engine's mesh must put this rank where the trainer's data sharding did."""
    mesh = getattr(engine, "mesh", None)
    got = (mesh.rank("data"), mesh.size("data")) if mesh is not None else (engine.rank, engine.world_size)
    if got != (rank, size):
        raise PolyaccelError(f"the trainer sharded its data as data rank {rank} of {size}, but the engine's mesh puts "
                             f"this rank at data rank {got[0]} of {got[1]}")


class EngineAdapter:
    """Wrap a polyaccel engine (``polyaccel.initialize``'s result) with the trainer-facing extras.

    - ``set_gradient_accumulation_boundary(is_boundary)``: the next :meth:`step` steps the optimizer
      (``True``) or only counts a micro-step (``False``), whatever the engine's own count says; used
      for a last, partial accumulation window of an epoch.
    - ``get_global_grad_norm()``: the global gradient norm of the last optimizer step (before
      clipping), or ``None`` before the first.
    - everything else (``backward``, ``forward``, ``save_checkpoint`` ...) is the engine's.
    """

    def __init__(self, engine):
        self.engine = engine
        self._boundary: bool | None = None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary = bool(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return self.engine.is_gradient_accumulation_boundary()

    def get_global_grad_norm(self) -> float | None:
        return self.engine.get_global_grad_norm()

    def step(self, boundary: bool | None = None) -> bool:
        """The engine's ``step(boundary=...)`` at the boundary the trainer chose (``boundary`` or the last
        ``set_gradient_accumulation_boundary``); True when the optimizer was applied."""
        want = self._boundary if boundary is None else bool(boundary)
        self._boundary = None
        return self.engine.step(boundary=want)
