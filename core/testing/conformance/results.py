"""The conformance result model: one row per check, and the stable JSON document.

Rows are built from pytest reports (see :mod:`.plugin`) and read back by
``polyaccel conformance``; the JSON layout is documented in ``docs/conformance-json.md``
and only ever grows (new keys), never renames or drops one within a schema version.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any

from ...errors import InvalidArgument
from ...safe_files import write_json

SCHEMA = "polyaccel-conformance"
SCHEMA_VERSION = 1

PASS = "PASS"
FAIL = "FAIL"
UNSUPPORTED = "UNSUPPORTED"  # the capability is not claimed and the plugin says so (raises Unsupported)
SKIPPED = "SKIPPED"
STATUSES = (PASS, FAIL, UNSUPPORTED, SKIPPED)

AREAS = ("suite", "device", "capability", "op", "comm")

#: user_properties keys the tests and the plugin exchange (they also show up in JUnit XML)
PROP_AREA = "polyaccel.area"
PROP_SUBJECT = "polyaccel.subject"
PROP_CHECK = "polyaccel.check"
PROP_VARIANT = "polyaccel.variant"
PROP_CLAIMED = "polyaccel.claimed"
PROP_STATUS = "polyaccel.status"
PROP_DETAIL = "polyaccel.detail"


@dataclass
class Row:
    """One check of the suite and its outcome."""

    area: str
    subject: str
    check: str
    variant: str = ""
    status: str = PASS
    reason: str = ""
    claimed: bool | None = None
    emulated: bool = False
    duration_s: float = 0.0
    test: str = ""

    @property
    def id(self) -> str:
        base = f"{self.area}/{self.subject}/{self.check}"
        return f"{base}[{self.variant}]" if self.variant else base

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["id"] = self.id
        d["duration_s"] = round(self.duration_s, 4)
        return d


@dataclass
class Document:
    """The whole conformance run, as written to ``--json``."""

    accelerator: dict[str, Any] | None
    rows: list[Row] = field(default_factory=list)
    error: str | None = None
    exit_status: int | None = None
    versions: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATUSES, 0)
        for r in self.rows:
            out[r.status] += 1
        return out

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.rows) and not any(r.status == FAIL for r in self.rows)

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "ok": self.ok,
            "error": self.error,
            "exit_status": self.exit_status,
            "accelerator": self.accelerator,
            "versions": self.versions,
            "duration_s": round(self.duration_s, 3),
            "counts": self.counts(),
            "rows": [r.as_dict() for r in self.rows],
        }

    def write(self, path: str) -> None:
        """Write atomically: a reader never sees half a document."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_json(path, self.as_dict(), indent=2, sort_keys=True, newline=True)


def versions() -> dict[str, Any]:
    import importlib.metadata as md

    def v(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "polyaccel": v("polyaccel"),
            "pytest": v("pytest")}


def load(path: str) -> dict[str, Any]:
    """Read a conformance JSON document and check it is one this version understands."""
    with open(path) as fh:
        data = json.load(fh)
    if data.get("schema") != SCHEMA:
        raise InvalidArgument(f"{path}: not a polyaccel conformance document (schema={data.get('schema')!r})")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise InvalidArgument(f"{path}: schema_version {data.get('schema_version')!r}, this polyaccel reads "
                         f"{SCHEMA_VERSION}")
    return data
