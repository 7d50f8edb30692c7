"""``polyaccel.initialize``: hand a model to an engine found through entry points.

Engines live outside the core (group ``polyaccel.engines``) exactly like backend
plugins, so the core never imports them.
"""

from __future__ import annotations

import importlib.metadata as md

from .errors import PolyaccelError

ENGINE_GROUP = "polyaccel.engines"


def load_engine(name: str):
    for ep in md.entry_points(group=ENGINE_GROUP):
        if ep.name == name:
            return ep.load()
    found = sorted({ep.name for ep in md.entry_points(group=ENGINE_GROUP)})
    raise PolyaccelError(
        f"no engine named {name!r} in entry-point group {ENGINE_GROUP!r} (found: {found or 'none'}); "
        "is polyaccel installed (pip install -e .)?"
    )


def initialize(model, config=None, *, engine: str = "zero", **kwargs):
    """Wrap ``model`` in a training engine (default: ZeRO) configured by ``config``."""
    return load_engine(engine)(model, config=config, **kwargs)
