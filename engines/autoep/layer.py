"""The ``expert_parallel`` model layer (entry point group ``polyaccel.layers``).

``polyaccel.initialize(model, {"expert_parallel": {"autoep_size": 2, ...}, ...})`` builds the
mesh with ``expert=autoep_size`` and calls :func:`apply` before the engine wraps the model.

It applies first (``ORDER`` 10, before AutoTP's 20): the experts it places carry their
:class:`~polyaccel.parallel.ParamLayout`, which tells AutoTP to leave them whole. On a mesh with
``tensor`` > 1 each tensor rank dispatches the same (replicated) tokens over its own expert group,
``mesh.group("expert")``, so experts are replicated over tensor ranks like any whole parameter.
"""

from __future__ import annotations

from polyaccel.errors import ConfigError

from .config import SECTION, SIZE_KEYS, parse_config  # noqa: F401 - SIZE_KEYS: read by polyaccel.initialize
from .config import mesh_sizes as _mesh_sizes
from .convert import convert
from .detect import detect

ORDER = 10


def mesh_sizes(section: dict) -> dict[str, int]:
    """``{"expert": autoep_size}`` (validates the section; the caller's dict is not modified)."""
    return _mesh_sizes(section)


def apply(model, section: dict, mesh):
    """Detect the MoE blocks and place their experts over ``mesh``'s ``expert`` dimension.

    Every check (section, detection, divisibility, mesh size) runs before any module changes.
    """
    cfg = parse_config(section)
    if not cfg.enabled:
        return model
    ep = mesh.size("expert")
    if ep != cfg.autoep_size:
        raise ConfigError(f"'{SECTION}.autoep_size' is {cfg.autoep_size} but the mesh's expert dimension is {ep}")
    plan = detect(model, cfg, ep, expert_data=mesh.size("expert_data"))
    group = mesh.group("expert") if ep > 1 else None
    return convert(model, plan, group=group, ep_rank=mesh.rank("expert"))
