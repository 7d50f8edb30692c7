"""What the code under test asked an emulated runtime, in order."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CallRecord:
    """One call the code under test made into the emulated runtime."""

    name: str
    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    result: Any = None


class CallLog(list):
    """Ordered list of :class:`CallRecord` with small query helpers."""

    def names(self) -> list[str]:
        return [c.name for c in self]

    def of(self, name: str) -> list[CallRecord]:
        return [c for c in self if c.name == name]

    def count_of(self, name: str) -> int:
        return sum(1 for c in self if c.name == name)

    def last(self, name: str) -> CallRecord:
        for c in reversed(self):
            if c.name == name:
                return c
        raise LookupError(f"the runtime was never called with {name!r}; calls: {self.names()}")
