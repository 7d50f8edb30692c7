"""The engine and model-layer contracts, as typed Protocols.

A plugin's contract is :mod:`polyaccel.hookspecs` (pluggy hooks) and :class:`polyaccel.Accelerator`. The
other two are here: what an engine entry point (group ``polyaccel.engines``) returns and what the trainer
integrations drive (:class:`TrainingEngine`, built by an :class:`EngineFactory`), and what a model-layer
entry point (group ``polyaccel.layers``) provides (:class:`ModelLayer`). Each member is documented where it
is declared. :func:`contract_mismatch` is the structural check discovery runs on every engine and layer it
loads (:mod:`polyaccel.extensions`): names, and for methods the parameters a caller passes.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TrainingEngine(Protocol):
    """The object ``polyaccel.initialize`` returns; ``polyaccel.engines.zero.ZeroEngine`` is the in-tree one.

    The integrations (Hugging Face Trainer, Lightning) drive an engine through these members only, so an
    engine that has them trains under every integration.
    """

    #: the device the engine keeps the model's working parameters on (the selected accelerator's)
    device: Any
    #: the gradient norm of the last optimizer boundary, before clipping (None before the first)
    last_grad_norm: float | None
    #: this process's rank and the number of processes; a trainer checks its data sharding against them
    #: when the engine has no ``mesh`` (an engine over a model layer's mesh has ``mesh.rank("data")`` too)
    rank: int
    world_size: int
    #: the wrapped model, whose ``named_parameters()`` and ``state_dict()`` a trainer reads
    module: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward."""

    def backward(self, loss: Any, retain_graph: bool = False) -> Any:
        """Backward of ``loss`` divided by the gradient-accumulation steps (and scaled for fp16); returns the
        loss it differentiated. Reduces gradients as the engine's sharding needs."""

    def step(self, boundary: bool | None = None) -> bool:
        """Count a micro-step; at an accumulation boundary apply the optimizer and zero the gradients.
        ``boundary=True`` steps now (a short last window), ``False`` only counts, ``None`` follows the
        engine's own count. True when the optimizer was applied (False: not a boundary, or skipped)."""

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` (with ``boundary=None``) applies the optimizer."""

    def get_global_grad_norm(self) -> float | None:
        """The last boundary's global gradient norm before clipping: ``inf`` when it was skipped for an fp16
        overflow, None before the first."""

    def was_step_applied(self) -> bool:
        """Whether the last boundary applied the optimizer (False after an fp16 overflow skipped it)."""

    def get_lr(self) -> float:
        """The optimizer's current learning rate."""

    def set_lr(self, lr: float) -> None:
        """Set the learning rate every later step uses (a trainer's scheduler calls it once per step)."""

    def full_state_dict(self) -> dict[str, Any]:
        """Every parameter, gathered whole, by name (collective when the parameters are sharded)."""

    def save_checkpoint(self, save_dir: Any, tag: str | None = None, client_state: Any = None) -> str:
        """Write a checkpoint under ``save_dir/tag`` (collective) and return the tag; ``client_state`` is
        JSON-serialisable and comes back from :meth:`load_checkpoint`."""

    def load_checkpoint(self, load_dir: Any, tag: str | None = None) -> Any:
        """Load the checkpoint ``tag`` (None: the one ``latest`` names) and return its ``client_state``."""


@runtime_checkable
class EngineFactory(Protocol):
    """What an entry point of group ``polyaccel.engines`` loads (``zero = polyaccel.engines.zero:initialize``).

    ``polyaccel.initialize(model, config, engine=name, **kwargs)`` calls it with the model after the model
    layers were applied, the config without the layers' sections, and ``mesh=`` when a layer built one.
    """

    #: optional: the top-level config keys the engine accepts; ``polyaccel.initialize`` refuses any other
    #: key (the layers' keys are added) before the model is touched. Without it the engine checks its own.
    CONFIG_KEYS: Iterable[str]

    def __call__(self, model: Any, config: Mapping[str, Any] | None = None, **kwargs: Any) -> TrainingEngine:
        """Wrap ``model`` in an engine configured by ``config``."""


@runtime_checkable
class ModelLayer(Protocol):
    """What an entry point of group ``polyaccel.layers`` loads (AutoTP, AutoEP: a module with these names).

    The entry point's name is the config key that turns the layer on (``tensor_parallel``). When a config
    names layers, ``polyaccel.initialize`` builds one mesh for all of them from their :meth:`mesh_sizes`,
    applies them in ascending :attr:`ORDER`, and hands the mesh to the engine.

    A layer may also define ``expand_section(value) -> dict``: the dict form of a section written as a
    shorthand (the model-kernels layer's ``"kernels": "auto"``); without it a section must be a dict.
    """

    #: layers apply in ascending order (AutoEP 10 converts experts before AutoTP 20 shards the rest)
    ORDER: int
    #: optional: mesh dimension -> the key of the layer's section that sets it (``{"tensor": "autotp_size"}``),
    #: so that a mesh that cannot be built names the config key the user wrote
    SIZE_KEYS: Mapping[str, str]

    def mesh_sizes(self, section: dict) -> dict[str, int]:
        """The mesh dimensions the layer needs for its config section (``{"tensor": 2}``); validates the
        section and raises ``ConfigError`` naming the bad key. Only reads ``section``."""

    def apply(self, model: Any, section: dict, mesh: Any) -> Any:
        """Shard ``model`` over the :class:`~polyaccel.comm.mesh.ParallelMesh` ``mesh`` and describe every
        parameter it changed with :func:`polyaccel.parallel.set_layout`; returns the model."""


#: members a satisfying object may leave out (its absence has a documented default)
OPTIONAL_MEMBERS: dict[type, frozenset[str]] = {
    EngineFactory: frozenset({"CONFIG_KEYS"}),
    ModelLayer: frozenset({"SIZE_KEYS"}),
}


def _declared(protocol: type) -> tuple[list[str], list[str]]:
    """(attribute names, method names) ``protocol`` declares, in declaration order."""
    attributes = list(protocol.__dict__.get("__annotations__", {}))
    methods = [name for name, value in protocol.__dict__.items()
               if inspect.isfunction(value) and (not name.startswith("_") or name == "__call__")]
    return attributes, methods


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _not_accepted(want: list[inspect.Parameter], have: dict[str, inspect.Parameter]) -> list[str]:
    """The contract's parameters ``have`` takes neither by name nor through ``*args`` / ``**kwargs``."""
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in have.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in have.values())
    return [p.name for p in want if p.kind not in _VARIADIC and p.name not in have
            and not (var_kw or (var_pos and p.default is p.empty))]


def _required_beyond(want: list[inspect.Parameter], have: dict[str, inspect.Parameter]) -> list[str]:
    """Parameters ``have`` requires that the contract never passes (what the contract's own ``*args`` /
    ``**kwargs`` pass on, any positional / keyword, is the caller's to give)."""
    passed_on = set()
    if any(p.kind is p.VAR_POSITIONAL for p in want):
        passed_on |= {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD}
    if any(p.kind is p.VAR_KEYWORD for p in want):
        passed_on |= {inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD}
    named = {p.name for p in want}
    return [p.name for p in have.values() if p.default is p.empty and p.kind not in passed_on
            and p.kind not in _VARIADIC and p.name not in named]


def _parameters_mismatch(expected, found, *, drop_first: bool = False) -> str | None:
    """Why ``found`` cannot be called the way the Protocol method ``expected`` is, or None.

    Every parameter of ``expected`` after ``self`` must be accepted under its name (or by ``*args`` /
    ``**kwargs``), and ``found`` may require nothing ``expected`` does not pass. ``drop_first``: ``found`` is
    a class's plain function, whose first parameter is the instance.
    """
    try:
        have = list(inspect.signature(found).parameters.values())
    except (TypeError, ValueError):
        return None  # a builtin without a signature: nothing to compare
    params = {p.name: p for p in (have[1:] if drop_first else have)}
    want = list(inspect.signature(expected).parameters.values())[1:]
    if missing := _not_accepted(want, params):
        return f"takes no parameter {', '.join(repr(m) for m in missing)}"
    if required := _required_beyond(want, params):
        return f"requires parameter {', '.join(repr(r) for r in required)} the contract does not pass"
    return None


def _method(obj: Any, name: str) -> tuple[Any, bool] | None:
    """(the callable that answers ``obj.<name>(...)``, whether its first parameter is the instance), or None.

    For a class this is what its instances would call: ``__call__`` counts only when the class defines it
    (a class itself is always callable), and a plain function takes the instance first.
    """
    if isinstance(obj, type):
        owner = next((k for k in obj.__mro__ if name in k.__dict__), None)
        if owner is None or owner is object or not callable(owner.__dict__[name]):
            return None
        static = isinstance(owner.__dict__[name], staticmethod)
        return getattr(obj, name), not static and inspect.isfunction(owner.__dict__[name])
    if name == "__call__":
        if not callable(obj):
            return None
        return (obj if inspect.isroutine(obj) else type(obj).__call__), not inspect.isroutine(obj)
    found = getattr(obj, name, None)
    return (found, False) if callable(found) else None


def contract_mismatch(obj: Any, protocol: type, *, attributes: bool = True) -> list[str]:
    """What ``obj`` lacks to satisfy ``protocol``: one phrase per missing or incompatible member, [] when none.

    ``obj`` may be an instance, a module or a function; or a class, checked for what its instances will have:
    then ``attributes=False`` leaves out the data attributes (an engine sets them in ``__init__``).
    """
    optional = OPTIONAL_MEMBERS.get(protocol, frozenset())
    declared_attributes, methods = _declared(protocol)
    problems = []
    if attributes:
        problems += [f"no attribute {name!r}" for name in declared_attributes
                     if name not in optional and not hasattr(obj, name)]
    for name in methods:
        member = _method(obj, name)
        if member is None:
            problems.append("is not callable" if name == "__call__" else f"no method {name!r}")
            continue
        why = _parameters_mismatch(getattr(protocol, name), member[0], drop_first=member[1])
        if why:
            problems.append(f"{'calling it' if name == '__call__' else name} {why}")
    return problems


__all__ = ["OPTIONAL_MEMBERS", "EngineFactory", "ModelLayer", "TrainingEngine", "contract_mismatch"]
