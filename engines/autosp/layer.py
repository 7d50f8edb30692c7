"""The ``sequence_parallel`` model layer that ``polyaccel.initialize`` applies (entry-point group
``polyaccel.layers``): it validates the config section, asks the mesh for ``sequence = autosp_size``
and puts Ulysses attention in the model (:mod:`.apply`); ZeRO then runs over ``data``, which holds
the sequence ranks (they are data replicas of every parameter), and divides by ``batch``.

It applies after AutoEP (10) and AutoTP (20), ``ORDER`` 25: it reads the heads AutoTP left
on each tensor rank, and splits those over the sequence ranks.
"""

from __future__ import annotations

from polyaccel.errors import ConfigError

from .apply import apply_sequence_parallel
from .config import SIZE_KEYS, parse  # noqa: F401 - SIZE_KEYS: read by polyaccel.initialize

ORDER = 25


def mesh_sizes(section: dict) -> dict:
    """``{"sequence": autosp_size}``; refuses a bad section, or a size that does not divide the world."""
    cfg = parse(section)
    from polyaccel import comm

    if comm.is_initialized():
        world = comm.get_world_size()
        if world % cfg.autosp_size:
            raise ConfigError(f"sequence_parallel.autosp_size {cfg.autosp_size} does not divide the world size "
                              f"{world}; sizes that fit: {[d for d in range(1, world + 1) if world % d == 0]}")
    return {"sequence": cfg.autosp_size}


def apply(model, section: dict, mesh):
    return apply_sequence_parallel(model, section, mesh)
