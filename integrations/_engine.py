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
    one model replica, the ranks of one sequence group parts of every sequence of one batch, and they must see
    the same batch. The mesh is ``(replica, expert, sequence, tensor)``, row-major, and the batches go by the
    flattened ``(replica, expert)``, the mesh's ``batch`` dimension (docs/engine-layers.md): expert parallelism
    is carved out of data parallelism, so expert ranks see different batches, and the data rank is
    ``rank // (tensor x sequence)``.
    """
    from ..engine_entry import launch_command, layer_mesh_sizes

    sizes = layer_mesh_sizes(config)
    tensor, expert, sequence = sizes.get("tensor", 1), sizes.get("expert", 1), sizes.get("sequence", 1)
    shared = tensor * sequence
    if world % shared or (world // shared) % expert:
        n = shared * expert
        what = f"tensor {tensor} x expert {expert}" + (f" x sequence {sequence}" if sequence > 1 else "")
        keys = "tensor_parallel and expert_parallel" + (" and sequence_parallel" if sequence > 1 else "")
        raise ConfigError(f"{what} (the config's {keys}) needs a multiple of {n} processes, one per device, but "
                          f"this run has {world}: start it with `{launch_command(n)}`")
    return rank // shared, world // shared


def sequence_axis(config, rank: int) -> tuple[int, int]:
    """(sequence rank, sequence size) of global ``rank`` for the layers ``config`` names (``(0, 1)`` without
    sequence parallelism): the sequence ranks sit between the tensor ranks and the batch ranks of the mesh."""
    from ..engine_entry import layer_mesh_sizes

    sizes = layer_mesh_sizes(config)
    tensor, sequence = sizes.get("tensor", 1), sizes.get("sequence", 1)
    return (rank // tensor) % sequence, sequence


def check_data_axis(engine, rank: int, size: int) -> None:
    """The engine's mesh must put this rank where the trainer's data sharding did."""
    mesh = getattr(engine, "mesh", None)
    got = (mesh.rank("batch"), mesh.size("batch")) if mesh is not None else (engine.rank, engine.world_size)
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
