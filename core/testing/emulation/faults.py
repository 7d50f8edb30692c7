"""Fault switches: the failures an emulated runtime can reproduce, declared by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Faults:
    """Fault switches of one runtime. Only declared names exist; each defaults to None (off).

    Switches can be flipped mid-test (``runtime.faults.unregister_fails = True``).
    """

    def __init__(self, runtime: str, declared: Mapping[str, str], given: Mapping[str, Any]):
        object.__setattr__(self, "_runtime", runtime)
        object.__setattr__(self, "_declared", dict(declared))
        object.__setattr__(self, "_values", {k: None for k in declared})
        for key, value in given.items():
            setattr(self, key, value)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(self._unknown(name))

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._declared:
            raise TypeError(self._unknown(name))
        self._values[name] = value

    def _unknown(self, name: str) -> str:
        known = ", ".join(f"{k} ({v})" for k, v in self._declared.items()) or "none"
        return f"unknown fault {name!r} for the emulated {self._runtime} runtime; known faults: {known}"

    def active(self) -> dict[str, Any]:
        return {k: v for k, v in self._values.items() if v}

    def __repr__(self) -> str:
        return f"Faults({self._runtime}, {self.active()})"
