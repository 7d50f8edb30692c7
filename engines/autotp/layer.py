"""The ``tensor_parallel`` model layer that ``polyaccel.initialize`` applies (entry-point group
``polyaccel.layers``): it validates the config section, asks the mesh for ``tensor = autotp_size``
and shards the model over that dimension; ZeRO then runs over ``data``.

It applies after AutoEP (``ORDER`` 20 > 10): parameters AutoEP already placed over ``expert`` carry
their :class:`~polyaccel.parallel.ParamLayout`, and AutoTP leaves them whole on every tensor rank
(the model plan's expert rules are dropped) while it splits attention, dense MLPs and the vocabulary."""

from __future__ import annotations

from polyaccel.errors import ConfigError

from .apply import apply_tensor_parallel
from .config import parse

ORDER = 20
#: the mesh dimension this section sets, and the key that sets it (named in mesh errors)
SIZE_KEYS = {"tensor": "autotp_size"}


def mesh_sizes(section: dict) -> dict:
    """``{"tensor": autotp_size}``; refuses a bad section, or a size that does not divide the world."""
    cfg = parse(section)
    from polyaccel import comm

    if comm.is_initialized():
        world = comm.get_world_size()
        if world % cfg.autotp_size:
            raise ConfigError(f"tensor_parallel.autotp_size {cfg.autotp_size} does not divide the world size {world}: "
                              f"the ranks form data x tensor groups, so autotp_size must be one of "
                              f"{[d for d in range(1, world + 1) if world % d == 0]}")
    return {"tensor": cfg.autotp_size}


def apply(model, section: dict, mesh):
    return apply_tensor_parallel(model, section, mesh)
