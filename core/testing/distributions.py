"""Temporary installed distributions, for testing entry-point discovery without pip.

``temporary_distribution`` writes a ``*.dist-info`` (METADATA + entry_points.txt) and the
given modules into a folder and puts it on ``sys.path``: ``importlib.metadata`` then sees
the entry points exactly as it sees a pip-installed package's.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import textwrap
from pathlib import Path


@contextlib.contextmanager
def temporary_distribution(root: Path, name: str, entry_points: dict[str, dict[str, str]],
                           modules: dict[str, str] | None = None, version: str = "1.0"):
    """Install ``name`` under ``root`` for the duration of the block.

    ``entry_points`` maps group -> {entry name: "module:attr"}; ``modules`` maps a module
    file name (``"pkg_x.py"``) to its source.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    dist = root / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in eps.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    written = []
    for fname, src in (modules or {}).items():
        (root / fname).write_text(textwrap.dedent(src))
        written.append(fname.removesuffix(".py"))
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        yield dist
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(root))
        for mod in written:
            sys.modules.pop(mod, None)
        importlib.invalidate_caches()
