"""``polyaccel.initialize``: hand a model to an engine found through entry points.

Engines live outside the core (group ``polyaccel.engines``) exactly like backend
plugins, so the core never imports them.

Model layers (group ``polyaccel.layers``) are the parallelism layers that reshape a model
before the engine wraps it (AutoTP, AutoEP). The entry point's name is the config key that
turns it on (``tensor_parallel``, ``expert_parallel``); the object it loads has

- ``ORDER``: an int; layers apply in ascending order;
- ``mesh_sizes(section: dict) -> dict``: the mesh dimensions it needs, e.g. ``{"tensor": 2}``
  (it validates its section here and raises ``ConfigError`` naming the bad key);
- optionally ``SIZE_KEYS``: mesh dimension -> the key of its section that sets it, e.g.
  ``{"expert": "autoep_size"}``, so that a mesh that cannot be built names the config key;
- ``apply(model, section: dict, mesh) -> model``: shard the model over the
  :class:`~polyaccel.comm.mesh.ParallelMesh` and describe every parameter it changed with
  :func:`polyaccel.parallel.set_layout`.

When a config names any layer, ``initialize`` builds one mesh for all of them, applies them,
and passes the mesh to the engine as ``mesh=``; the engine receives the config without the
layers' sections. The caller's dict is never modified.
"""

from __future__ import annotations

import copy
import importlib.metadata as md

from .errors import ConfigError, PolyaccelError

ENGINE_GROUP = "polyaccel.engines"
LAYER_GROUP = "polyaccel.layers"


def load_engine(name: str):
    for ep in md.entry_points(group=ENGINE_GROUP):
        if ep.name == name:
            return ep.load()
    found = sorted({ep.name for ep in md.entry_points(group=ENGINE_GROUP)})
    raise PolyaccelError(
        f"no engine named {name!r} in entry-point group {ENGINE_GROUP!r} (found: {found or 'none'}); "
        "is polyaccel installed (pip install -e .)?"
    )


def model_layers() -> dict[str, object]:
    """Config key -> layer entry point (not loaded)."""
    return {ep.name: ep for ep in md.entry_points(group=LAYER_GROUP)}


def apply_layers(model, config: dict, mesh=None):
    """Apply the layers ``config`` names; returns ``(model, engine_config, mesh_or_None)``."""
    cfg = copy.deepcopy(config) if config else {}
    if not isinstance(cfg, dict):
        return model, cfg, mesh
    known = model_layers()
    chosen = {key: known[key].load() for key in list(cfg) if key in known}
    sections = {key: cfg.pop(key) for key in chosen}
    if not chosen:
        return model, cfg, mesh
    sizes: dict[str, int] = {}
    keys: dict[str, str] = {}  # mesh dimension -> the config key that set it
    for key, layer in chosen.items():
        if not isinstance(sections[key], dict):
            raise ConfigError(f"config key {key!r} must be a dict, got {type(sections[key]).__name__}")
        for dim, n in layer.mesh_sizes(sections[key]).items():
            if dim in sizes and sizes[dim] != n:
                raise ConfigError(f"two layers ask for different {dim} sizes: {sizes[dim]} and {n}")
            sizes[dim] = n
            keys[dim] = f"{key}.{getattr(layer, 'SIZE_KEYS', {}).get(dim, dim)}"
    if mesh is None:
        from .comm import init_distributed, is_initialized
        from .comm.mesh import init_parallel_mesh

        if not is_initialized():
            init_distributed()
        try:
            mesh = init_parallel_mesh(tensor=sizes.get("tensor", 1), expert=sizes.get("expert", 1))
        except ConfigError as exc:  # the mesh speaks of dimensions; the caller wrote config keys
            named = ", ".join(f"'{keys[d]}'={sizes[d]}" for d in sorted(keys) if sizes[d] != 1)
            raise ConfigError(f"{named or 'the config'}: {exc}") from None
    else:
        for dim, n in sizes.items():
            if mesh.size(dim) != n:
                raise ConfigError(f"the mesh passed has {dim}={mesh.size(dim)} but the config asks for {n}")
    for key, layer in sorted(chosen.items(), key=lambda kv: kv[1].ORDER):
        model = layer.apply(model, sections[key], mesh)
    return model, cfg, mesh


def initialize(model, config=None, *, engine: str = "zero", **kwargs):
    """Wrap ``model`` in a training engine (default: ZeRO) configured by ``config``."""
    model, cfg, mesh = apply_layers(model, config, kwargs.pop("mesh", None))
    if mesh is not None:
        kwargs["mesh"] = mesh
    return load_engine(engine)(model, config=cfg if config is not None else None, **kwargs)
