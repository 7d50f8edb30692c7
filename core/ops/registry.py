"""Op builders and the registry that picks the best one per (op, device type).

An *op* is a named function with one semantics everywhere (the core's reference
implementation defines it). A *builder* is one way to get that op on some device
types: a Triton kernel, a native extension, a vendor library, plain torch. Builders
are contributed by plugins through the ``polyaccel_op_builders`` hook; resolution
happens once per (op, device type) and the loaded callable is then called directly.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import OpError

ANY_DEVICE = "*"
KINDS = ("triton", "native", "vendor", "torch", "reference")


def _always_compatible(accelerator) -> tuple[bool, str]:
    return True, ""


@dataclass(eq=False)
class OpBuilder:
    """One way to provide ``op`` on ``device_types``.

    ``loader`` takes no argument, is called at most once, on first use, and returns the
    op's callable: a function with exactly the signature of the op's reference in
    :mod:`polyaccel.ops.reference` (docs/plugin-authoring.md lists them). A loader that
    raises, or returns something that is not callable, fails the builder: the registry
    falls through to the next candidate and ``explain`` shows why.
    ``compatible(accelerator)`` answers (ok, reason) cheaply, without loading; the
    accelerator passed is the one serving the device type (None if none is usable).
    """

    op: str
    name: str
    device_types: tuple[str, ...]
    loader: Callable[[], Callable[..., Any]]
    kind: str = "torch"
    priority: int = 0
    compatible: Callable[[Any], tuple[bool, str]] = _always_compatible
    plugin: str = ""
    description: str = ""
    _loaded: Callable[..., Any] | None = field(default=None, repr=False)
    _load_error: BaseException | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise OpError(f"builder {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if isinstance(self.device_types, str):
            self.device_types = (self.device_types,)

    def serves(self, device_type: str) -> bool:
        return ANY_DEVICE in self.device_types or device_type in self.device_types

    def is_compatible(self, accelerator) -> tuple[bool, str]:
        if self._load_error is not None:
            return False, f"load failed: {type(self._load_error).__name__}: {self._load_error}"
        try:
            ok, reason = self.compatible(accelerator)
        except Exception as exc:  # noqa: BLE001 - a broken check means "not compatible"
            return False, f"compatibility check raised {type(exc).__name__}: {exc}"
        return bool(ok), reason or ""

    def load(self) -> Callable[..., Any]:
        if self._loaded is None:
            try:
                fn = self.loader()
                if not callable(fn):
                    raise TypeError(f"its loader returned {_short_repr(fn)}, not the op's callable "
                                    "(a loader must return the function that runs the op)")
            except Exception as exc:
                self._load_error = exc
                raise OpError(f"op builder {self.name!r} for {self.op!r} failed to load: {exc}") from exc
            self._loaded = fn
        return self._loaded


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class Candidate:
    builder: OpBuilder
    chosen: bool
    reason: str

    def as_dict(self) -> dict[str, Any]:
        b = self.builder
        return {
            "builder": b.name,
            "plugin": b.plugin,
            "kind": b.kind,
            "priority": b.priority,
            "device_types": list(b.device_types),
            "chosen": self.chosen,
            "reason": self.reason,
        }


def _override_from_env() -> dict[str, str]:
    """POLYACCEL_OP_OVERRIDES="fused_adam=torch_fused_adam,quantize=reference"."""
    raw = os.environ.get("POLYACCEL_OP_OVERRIDES", "")
    out = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise OpError(
                f"POLYACCEL_OP_OVERRIDES entry {item!r} is not 'op=builder' "
                "(e.g. POLYACCEL_OP_OVERRIDES=fused_adam=reference)"
            )
        op, name = item.split("=", 1)
        out[op.strip()] = name.strip()
    return out


class OpRegistry:
    """All builders of all plugins, and the per-(op, device type) choice."""

    def __init__(self, accelerator_for: Callable[[str | None], Any] | None = None, lock=None):
        """``accelerator_for(device_type)`` gives the accelerator serving a device type (None if none is
        usable); ``accelerator_for(None)`` gives this process's accelerator, which ``explain`` defaults to."""
        self._builders: dict[str, list[OpBuilder]] = {}
        self._cache: dict[tuple[str, str], Callable[..., Any]] = {}
        self._chosen: dict[tuple[str, str], OpBuilder] = {}
        self._overrides: dict[str, str] = {}
        #: plugin -> (why its op registration failed, [(op, builder name) it had added])
        self._failures: dict[str, tuple[str, list[tuple[str, str]]]] = {}
        self._lock = lock if lock is not None else threading.RLock()
        self._populated = False
        self._populate: Callable[[OpRegistry], None] | None = None
        self._accelerator_for = accelerator_for or (lambda device_type: None)

    # -------------------------------------------------------------- building
    def add(self, builder: OpBuilder) -> OpBuilder:
        with self._lock:
            existing = self._builders.setdefault(builder.op, [])
            if any(b.name == builder.name for b in existing):
                raise OpError(f"op {builder.op!r} already has a builder named {builder.name!r}")
            existing.append(builder)
            self._cache.clear()
            self._chosen.clear()
        return builder

    def register(self, op: str, name: str, device_types, loader, **kw) -> OpBuilder:
        """Shorthand for ``add(OpBuilder(op, name, device_types, loader, **kw))``."""
        return self.add(OpBuilder(op=op, name=name, device_types=tuple(device_types), loader=loader, **kw))

    def record_plugin_failure(self, plugin: str, reason: str, dropped: list[tuple[str, str]]) -> None:
        """Remember that ``plugin``'s builders are ignored and why (shown by :meth:`explain`)."""
        with self._lock:
            self._failures[plugin] = (reason, list(dropped))

    def plugin_failures(self) -> dict[str, dict[str, Any]]:
        """Plugins whose op registration failed: name -> ``{reason, dropped_builders}``."""
        self._ensure()
        return {p: {"reason": r, "dropped_builders": [f"{name} ({op})" for op, name in d]}
                for p, (r, d) in self._failures.items()}

    def reset(self) -> None:
        with self._lock:
            self._failures.clear()
            self._builders.clear()
            self._cache.clear()
            self._chosen.clear()
            self._overrides.clear()
            self._populated = False

    def set_populator(self, fn: Callable[[OpRegistry], None]) -> None:
        self._populate = fn

    def _ensure(self) -> None:
        if not self._populated:
            with self._lock:
                if not self._populated:
                    self._populated = True
                    if self._populate is not None:
                        self._populate(self)

    # ------------------------------------------------------------- override
    def override(self, op: str, builder_name: str | None) -> None:
        """Force ``op`` to use the builder named ``builder_name`` (None removes the override)."""
        self._ensure()
        with self._lock:
            if builder_name is None:
                self._overrides.pop(op, None)
            else:
                names = [b.name for b in self._builders.get(op, [])]
                if builder_name not in names:
                    raise OpError(
                        f"cannot override {op!r} with {builder_name!r}: known builders are {names}"
                    )
                self._overrides[op] = builder_name
            self._cache = {k: v for k, v in self._cache.items() if k[0] != op}
            self._chosen = {k: v for k, v in self._chosen.items() if k[0] != op}

    # ------------------------------------------------------------ resolution
    def ops(self) -> list[str]:
        self._ensure()
        return sorted(self._builders)

    def builders(self, op: str) -> list[OpBuilder]:
        self._ensure()
        return list(self._builders.get(op, []))

    def candidates(self, op: str, device_type: str) -> list[Candidate]:
        """Every builder of ``op`` with whether it would be chosen for ``device_type`` and why."""
        self._ensure()
        builders = self._builders.get(op)
        if not builders:
            raise OpError(f"unknown op {op!r}; known ops: {sorted(self._builders)}")
        acc = self._accelerator_for(device_type)
        forced = self._overrides.get(op) or _override_from_env().get(op)
        ordered = sorted(builders, key=lambda b: b.priority, reverse=True)
        out: list[Candidate] = []
        winner: OpBuilder | None = None
        for b in ordered:
            if not b.serves(device_type):
                out.append(Candidate(b, False, f"does not serve device type {device_type!r}"))
                continue
            ok, why = b.is_compatible(acc)
            if not ok:
                out.append(Candidate(b, False, f"incompatible: {why}"))
                continue
            if forced is not None and b.name != forced:
                out.append(Candidate(b, False, f"compatible, but the override selects {forced!r}"))
                continue
            if winner is None:
                winner = b
                why = f"override {forced!r}" if forced else f"highest-priority compatible builder ({b.priority})"
                out.append(Candidate(b, True, why))
            else:
                out.append(Candidate(b, False, f"compatible, outranked by {winner.name!r}"))
        if forced is not None and winner is None:
            raise OpError(
                f"override selects builder {forced!r} for {op!r} on {device_type!r}, but it is not "
                f"usable there: " + "; ".join(f"{c.builder.name}: {c.reason}" for c in out)
            )
        return out

    def resolve(self, op: str, device_type: str) -> Callable[..., Any]:
        """The callable for ``op`` on ``device_type`` (cached after the first call)."""
        key = (op, device_type)
        fn = self._cache.get(key)
        if fn is not None:
            return fn
        with self._lock:
            for _ in range(8):  # a builder failing to load falls through to the next one
                cands = self.candidates(op, device_type)
                chosen = next((c.builder for c in cands if c.chosen), None)
                if chosen is None:
                    raise OpError(
                        f"no builder of {op!r} can run on device type {device_type!r}: "
                        + "; ".join(f"{c.builder.name}: {c.reason}" for c in cands)
                    )
                try:
                    fn = chosen.load()
                except OpError:
                    if self._overrides.get(op) == chosen.name:
                        raise
                    continue
                self._cache[key] = fn
                self._chosen[key] = chosen
                return fn
        raise OpError(f"could not load any builder of {op!r} for {device_type!r}")

    def chosen(self, op: str, device_type: str) -> OpBuilder:
        self.resolve(op, device_type)
        return self._chosen[(op, device_type)]

    def explain(self, op: str, device_type: str | None = None) -> str:
        """A readable table of every candidate for ``op`` and why it was or was not chosen."""
        if device_type is None:
            acc = self._accelerator_for(None)
            if acc is None:
                raise OpError(f"explain({op!r}): no accelerator to take the device type from; pass device_type")
            device_type = acc.device_type
        lines = [f"op {op!r} on device type {device_type!r}:"]
        for c in self.candidates(op, device_type):
            mark = "->" if c.chosen else "  "
            b = c.builder
            lines.append(
                f" {mark} {b.name:<28} plugin={b.plugin or '-':<10} kind={b.kind:<9} "
                f"priority={b.priority:<4} {c.reason}"
            )
        for plugin, info in self.plugin_failures().items():
            dropped = info["dropped_builders"]
            lines.append(f" !! plugin {plugin!r}: builders ignored: {info['reason']}"
                         + (f" (dropped: {', '.join(dropped)})" if dropped else ""))
        return "\n".join(lines)
