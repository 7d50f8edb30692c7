"""How op builders get into the registry: the core's reference builders, then each plugin's.

Each plugin's op hooks are called through pluggy for that plugin alone
(:func:`polyaccel.discovery.plugin_hook`), so a hook that raises, or returns something that
is not a usable builder, fails only its plugin: none of its builders is used, the registry
keeps the reason (``explain`` shows it) and the plugin is isolated (``polyaccel report``).
Builders enter the registry only after their plugin's hooks returned and passed the checks.
"""

from __future__ import annotations

from .. import discovery
from . import builtin
from .registry import OpBuilder, OpRegistry

HOOK = "polyaccel_op_builders"
#: the contract-1.0 form: the hook adds builders to the registry object it is given
REGISTRY_HOOK = "polyaccel_register_ops"


class BuilderCollector:
    """What a ``polyaccel_register_ops(registry)`` implementation receives: it collects what is added."""

    def __init__(self, plugin: str):
        self.plugin = plugin
        self.builders: list[OpBuilder] = []

    def add(self, builder: OpBuilder) -> OpBuilder:
        self.builders.append(builder)
        return builder

    def register(self, op, name, device_types, loader, **kw) -> OpBuilder:
        """Shorthand for ``add(OpBuilder(op, name, device_types, loader, **kw))``."""
        kw.setdefault("plugin", self.plugin)
        return self.add(OpBuilder(op=op, name=name, device_types=tuple(device_types), loader=loader, **kw))


class _PluginOpsFailed(Exception):
    def __init__(self, reason: str, builders: list):
        super().__init__(reason)
        self.reason = reason
        self.dropped = [b for b in builders if isinstance(b, OpBuilder)]


def register_all(registry: OpRegistry, found: discovery.PluginSet) -> None:
    """The reference builders, then every loaded plugin's, in discovery order.

    Unavailable plugins contribute too: ``explain`` then shows why their builders are not used.
    """
    builtin.register_reference_ops(registry)
    for rec in list(found.records.values()):
        if rec.status not in discovery.LOADED_STATUSES or found.pm.get_plugin(rec.name) is not rec.plugin:
            continue  # not loaded, or a further accelerator record of a plugin handled under its own name
        try:
            builders = _checked(registry, rec.name, _collect(found, rec))
        except _PluginOpsFailed as failure:
            registry.record_plugin_failure(rec.name, failure.reason, [(b.op, b.name) for b in failure.dropped])
            discovery.isolate(found, rec, failure.reason)
            continue
        for builder in builders:
            registry.add(builder)
        if rec.status == discovery.LOADED:
            listed = ", ".join(f"{b.name} ({b.op})" for b in builders)
            rec.reason = ("provides no accelerator (nothing to select); "
                          + (f"op builders: {listed}" if listed else "its hooks are in use"))


def _collect(found: discovery.PluginSet, rec: discovery.PluginRecord) -> list:
    """What the plugin's op hooks give: the returned builders, then those added to the collector."""
    returned: list = []
    collector = BuilderCollector(rec.name)
    for hook, kwargs in ((HOOK, {}), (REGISTRY_HOOK, {"registry": collector})):
        try:
            answers = discovery.plugin_hook(found.pm, hook, rec.plugin)(**kwargs)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - isolate a broken plugin's ops
            raise _PluginOpsFailed(f"{hook} raised {type(exc).__name__}: {exc}",
                                   returned + collector.builders) from exc
        for answer in answers:
            if answer is not None:
                returned += [answer] if isinstance(answer, OpBuilder) else list(answer)
    return returned + collector.builders


def _checked(registry: OpRegistry, plugin: str, builders: list) -> list[OpBuilder]:
    """``builders`` stamped with their plugin, once each is known to be an OpBuilder with a free name."""
    seen: set[tuple[str, str]] = set()
    for builder in builders:
        if not isinstance(builder, OpBuilder):
            raise _PluginOpsFailed(f"its op hook gave {_short(builder)}, not a polyaccel.ops.OpBuilder", builders)
        if not builder.plugin:
            builder.plugin = plugin
        key = (builder.op, builder.name)
        owner = "this plugin" if key in seen else next(
            (f"plugin {b.plugin or '?'!r}" for b in registry.builders(builder.op) if b.name == builder.name), None)
        if owner is not None:
            raise _PluginOpsFailed(f"its op builder {builder.name!r} is not usable: op {builder.op!r} already has a "
                                   f"builder named {builder.name!r} (from {owner}); builder names are unique per op",
                                   builders)
        seen.add(key)
    return builders


def _short(value) -> str:
    text = f"{type(value).__name__} {value!r}"
    return text if len(text) <= 80 else text[:77] + "..."
