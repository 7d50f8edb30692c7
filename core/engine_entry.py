"""``polyaccel.initialize``: hand a model to an engine found through entry points.

Engines live outside the core (group ``polyaccel.engines``) exactly like backend
plugins, so the core never imports them.

Model layers (group ``polyaccel.layers``) are the parallelism layers that reshape a model
before the engine wraps it (AutoTP, AutoEP). The entry point's name is the config key that
turns it on (``tensor_parallel``, ``expert_parallel``). What an engine and a layer provide is
written down in :mod:`polyaccel.contracts` (:class:`~polyaccel.contracts.EngineFactory`,
:class:`~polyaccel.contracts.TrainingEngine`, :class:`~polyaccel.contracts.ModelLayer`); both are
found by :mod:`polyaccel.extensions`, which isolates one that fails to import or to satisfy its
contract (``polyaccel report`` shows it with the reason) and lets the others work.

When a config names any layer, ``initialize`` builds one mesh for all of them, applies them,
and passes the mesh to the engine as ``mesh=``; the engine receives the config without the
layers' sections. The caller's dict is never modified.

Before anything changes, ``initialize`` checks two things that only the whole picture can: a config
key that neither the engine (its ``CONFIG_KEYS``, when the engine object has them) nor any layer
knows is refused with every allowed key listed, layers' included; and a layout that needs more
than one process (tensor x expert > 1), asked for in a process started without a launcher, is
refused with the number of processes it needs and the ``torchrun`` command that starts them.
"""

from __future__ import annotations

import copy
import importlib.metadata as md
import os
import socket
import sys

from .config_check import Section
from .contracts import TrainingEngine, contract_mismatch
from .errors import ConfigError, PolyaccelError
from .extensions import ENGINE_GROUP, LAYER_GROUP, by_name, discover_extensions, entry_point_names


def load_engine(name: str):
    rec = by_name(discover_extensions(ENGINE_GROUP, {name})).get(name)
    if rec is None:
        found = entry_point_names(ENGINE_GROUP)
        raise PolyaccelError(
            f"no engine named {name!r} in entry-point group {ENGINE_GROUP!r} (found: {found or 'none'}); "
            "is polyaccel installed (pip install -e .)?"
        )
    if rec.obj is None:
        raise PolyaccelError(f"engine {name!r} ({rec.source}) is isolated: {rec.reason}; see `polyaccel report`")
    return rec.obj


def model_layers() -> dict[str, object]:
    """Config key -> layer entry point (not loaded)."""
    return {ep.name: ep for ep in md.entry_points(group=LAYER_GROUP)}


def _chosen_layers(config) -> dict[str, object]:
    """Config key -> loaded layer, for the layer keys ``config`` names; an isolated one is refused with why."""
    if not isinstance(config, dict):
        return {}
    names = {key for key in config if isinstance(key, str)} & set(model_layers())
    if not names:
        return {}
    records = by_name(discover_extensions(LAYER_GROUP, names))
    isolated = [rec for rec in records.values() if rec.obj is None]
    if isolated:
        raise ConfigError("; ".join(f"config key {rec.name!r} turns on the model layer {rec.source}, which is "
                                    f"isolated: {rec.reason}" for rec in isolated) + "; see `polyaccel report`")
    return {key: records[key].obj for key in list(config) if key in records}


def _layer_sizes(config: dict, chosen: dict) -> tuple[dict[str, int], dict[str, str]]:
    """(mesh dimension -> size, mesh dimension -> the config key that set it, e.g. 'tensor_parallel.autotp_size')."""
    sizes: dict[str, int] = {}
    keys: dict[str, str] = {}
    for key, layer in chosen.items():
        section = layer_section(key, layer, config[key])
        for dim, n in layer.mesh_sizes(section).items():
            if dim in sizes and sizes[dim] != n:
                raise ConfigError(f"two layers ask for different {dim} sizes: {sizes[dim]} and {n}")
            sizes[dim] = n
            keys[dim] = f"{key}.{getattr(layer, 'SIZE_KEYS', {}).get(dim, dim)}"
    return sizes, keys


def layer_section(key: str, layer, value) -> dict:
    """A layer's config section as a dict: a layer with ``expand_section`` also takes its shorthands (the
    model-kernels layer's ``"kernels": "auto"``), expanded into a new dict."""
    expand = getattr(layer, "expand_section", None)
    if expand is not None and not isinstance(value, dict):
        value = expand(value)
    if not isinstance(value, dict):
        raise ConfigError(f"config key {key!r} must be a dict, got {type(value).__name__}")
    return value


def layer_mesh_sizes(config) -> dict[str, int]:
    """The mesh sizes the layers ``config`` names ask for, e.g. ``{"tensor": 2, "expert": 2}`` (each layer
    validates its section); ``{}`` when it names none. ``config`` is only read."""
    return _layer_sizes(config, _chosen_layers(config))[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(processes: int) -> str:
    """The ``torchrun`` command that starts this script on ``processes`` processes."""
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "your_script.py"
    return f"torchrun --nproc-per-node {processes} {script}"


def _ensure_world(sizes: dict[str, int], keys: dict[str, str]) -> None:
    """Initialise ``polyaccel.comm`` for the layers: from a launcher's environment, else as a world of one when
    the layout fits in one process; a layout that needs more is refused with the command that starts it."""
    from .comm import init_distributed, is_initialized

    if is_initialized():
        return
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        init_distributed()
        return
    needed = 1
    for n in sizes.values():
        needed *= n
    if needed > 1:
        asked = ", ".join(f"'{keys[d]}'={sizes[d]}" for d in sorted(keys) if sizes[d] != 1)
        raise ConfigError(
            f"{asked}: this layout needs {needed} processes (or a multiple of {needed}), one per device, but this "
            "process was started alone, without a launcher (RANK, WORLD_SIZE and MASTER_ADDR are not set); start "
            f"it with `{launch_command(needed)}`")
    init_distributed(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


def check_config_keys(config, engine_keys) -> None:
    """Refuse a top-level config key that neither the engine (``engine_keys``; None: the engine checks its own)
    nor a model layer knows, listing every key allowed at that level (with a did-you-mean)."""
    if engine_keys is None or not isinstance(config, dict):
        return
    Section(config, "", {str(k) for k in engine_keys} | set(model_layers()))


def apply_layers(model, config: dict, mesh=None):
    """Apply the layers ``config`` names; returns ``(model, engine_config, mesh_or_None)``."""
    cfg = copy.deepcopy(config) if config else {}
    if not isinstance(cfg, dict):
        return model, cfg, mesh
    chosen = _chosen_layers(cfg)
    if not chosen:
        return model, cfg, mesh
    sizes, keys = _layer_sizes(cfg, chosen)
    sections = {key: layer_section(key, chosen[key], cfg.pop(key)) for key in chosen}
    if mesh is None:
        from .comm.mesh import init_parallel_mesh

        _ensure_world(sizes, keys)
        try:
            mesh = init_parallel_mesh(tensor=sizes.get("tensor", 1), expert=sizes.get("expert", 1),
                                      sequence=sizes.get("sequence", 1))
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
    factory = load_engine(engine)
    check_config_keys(config, getattr(factory, "CONFIG_KEYS", None))
    model, cfg, mesh = apply_layers(model, config, kwargs.pop("mesh", None))
    if mesh is not None:
        kwargs["mesh"] = mesh
    built = factory(model, config=cfg if config is not None else None, **kwargs)
    problems = contract_mismatch(built, TrainingEngine)
    if problems:
        raise PolyaccelError(f"engine {engine!r} returned a {type(built).__name__}, which does not satisfy "
                             f"polyaccel.contracts.TrainingEngine: {'; '.join(problems)}")
    return built
