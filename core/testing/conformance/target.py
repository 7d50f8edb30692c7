"""Which accelerator the suite certifies, and entering its emulated runtime when asked."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

ENV_ACCELERATOR = "POLYACCEL_ACCELERATOR"


class TargetError(Exception):
    """The accelerator to certify could not be selected; the message says why and what to do."""


@dataclass
class Target:
    """The accelerator under test and what the suite needs to know about its plugin."""

    accelerator: Any
    plugin_names: frozenset[str]  # names the plugin's op builders are stamped with
    source: str = ""
    emulated: bool = False
    capabilities: frozenset[str] = field(default_factory=frozenset)

    @property
    def name(self) -> str:
        return self.accelerator.name

    @property
    def device_type(self) -> str:
        return self.accelerator.device_type

    def claims(self, capability: str) -> bool:
        return capability in self.capabilities

    def describe(self) -> dict[str, Any]:
        acc = self.accelerator
        try:
            count = int(acc.device_count())
        except Exception:  # noqa: BLE001 - the device tests report it properly
            count = None
        return {
            "name": acc.name,
            "device_type": acc.device_type,
            "plugin": sorted(self.plugin_names)[0] if self.plugin_names else None,
            "source": self.source,
            "api_version": acc.api_version,
            "priority": acc.priority,
            "communication_backend": acc.communication_backend,
            "capabilities": sorted(self.capabilities),
            "emulated": self.emulated,
            "device_count": count,
        }


def requested_name(option: str | None) -> str | None:
    return (option or os.environ.get(ENV_ACCELERATOR, "").strip()) or None


def available_emulations() -> list[str]:
    """Names of the accelerators some installed plugin offers an emulated runtime for."""
    from ..emulation import emulated_runtimes

    return emulated_runtimes().names()


def enter_emulation(stack: contextlib.ExitStack, name: str | None) -> Any:
    """Enter, on ``stack``, the emulated runtime a plugin offers for accelerator ``name`` (through its hook)."""
    from ..emulation import EmulationError, emulated_runtimes

    if not name:
        raise TargetError("--emulate needs the accelerator's name (--accelerator NAME): emulated runtimes "
                          "are offered per accelerator")
    try:
        runtime = emulated_runtimes().runtime(name)
    except EmulationError as exc:
        raise TargetError(f"{exc}. Run without --emulate on real hardware.") from None
    return stack.enter_context(runtime.emulate())


def select_target(name: str | None) -> Target:
    """Select ``name`` (or this process's default accelerator) through the normal selection path."""
    from polyaccel import selection

    try:
        acc = selection.set_accelerator(name) if name else selection.get_accelerator()
    except Exception as exc:  # noqa: BLE001 - becomes a clear usage error
        raise TargetError(f"cannot select the accelerator to certify: {exc}") from exc
    ps = selection.plugins()
    owner = next((r for r in ps.records.values() if r.accelerator is acc), None)
    names = {acc.name}
    source = ""
    if owner is not None:
        source = owner.source
        names |= {r.name for r in ps.records.values() if owner.plugin is not None and r.plugin is owner.plugin}
        names.add(owner.name)
    try:
        emulated = bool(acc.is_emulated()) or bool(owner is not None and owner.emulated)
    except Exception:  # noqa: BLE001
        emulated = False
    return Target(accelerator=acc, plugin_names=frozenset(names), source=source, emulated=emulated,
                  capabilities=frozenset(acc.capabilities()))
