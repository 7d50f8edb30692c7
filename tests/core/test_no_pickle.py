"""No file the package reads is unpickled beyond torch's ``weights_only`` loader (parsed with ``ast``, not regex).

Forbidden in core/, engines/, plugins/ and apps/: ``weights_only=False``; ``torch.load`` without
``weights_only=True``; ``pickle.load``/``loads``/``Unpickler`` (and the same from ``_pickle``, ``cPickle``,
``dill``, ``cloudpickle``, ``joblib``), whether called through the module or imported from it;
``allow_pickle=True`` (numpy's loader).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("core", "engines", "plugins", "apps", "integrations")
PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib"}
LOADERS = {"load", "loads", "Unpickler"}

#: (file, function) pairs allowed to unpickle, each with the reason
ALLOWED = {
    # run_ranks' parent reads back what the child ranks it started itself send over its own pipe (their return
    # values and exceptions): no file, nothing a user hands in; multiprocessing's Connection.recv unpickles the
    # same bytes the same way, so moving onto it would hide the call from this test without changing the trust.
    ("core/testing/multiprocess.py", "_read"): "a child rank's result over run_ranks' own pipe",
    # the child checks that the exception it is about to send can be unpickled in the parent
    ("core/testing/multiprocess.py", "_rank_main"): "round trip of the child's own exception before sending it",
}


def _is_const(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def violations(source: str, filename: str = "<src>") -> list[tuple[int, str, str]]:
    """(line, enclosing function, what) for every forbidden construct in ``source``."""
    tree = ast.parse(source, filename)
    imported: dict[str, str] = {}  # local name -> "pickle.loads" for `from pickle import loads [as x]`
    aliases: dict[str, str] = {}  # local name -> module, for `import pickle as p`
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in PICKLE_MODULES:
            for a in node.names:
                if a.name in LOADERS:
                    imported[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in PICKLE_MODULES:
                    aliases[a.asname or a.name] = a.name
    found = []

    def visit(node, func: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        if isinstance(node, ast.Call):
            name = _dotted(node.func) or ""
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            if "weights_only" in kw and not _is_const(kw["weights_only"], True):
                found.append((node.lineno, func, f"{name}(weights_only={ast.unparse(kw['weights_only'])})"))
            elif name.split(".")[-1] == "load" and name.split(".")[0] in ("torch", "serialization") \
                    and "weights_only" not in kw:
                found.append((node.lineno, func, f"{name}() without weights_only=True"))
            if "allow_pickle" in kw and not _is_const(kw["allow_pickle"], False):
                found.append((node.lineno, func, f"{name}(allow_pickle={ast.unparse(kw['allow_pickle'])})"))
            head, _, attr = name.rpartition(".")
            if head in aliases and attr in LOADERS:
                found.append((node.lineno, func, f"{aliases[head]}.{attr}()"))
            if name in imported:
                found.append((node.lineno, func, f"{imported[name]}() (imported as {name})"))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return found


def package_files() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py"))


def test_the_checker_finds_each_forbidden_form():
    src = """
import pickle, torch
import pickle as pk
import numpy as np
from dill import loads as dl
def f(path, flag):
    torch.load(path)
    torch.load(path, weights_only=False)
    torch.load(path, weights_only=flag)
    pickle.load(open(path, "rb"))
    pk.loads(b"")
    pickle.Unpickler(open(path, "rb")).load()
    dl(b"")
    np.load(path, allow_pickle=True)
def ok(path):
    torch.load(path, weights_only=True, map_location="cpu")
    pickle.dumps(1)
    np.load(path)
"""
    got = violations(src)
    assert [line for line, _, _ in got] == [7, 8, 9, 10, 11, 12, 13, 14], got
    assert all(func == "f" for _, func, _ in got)


def test_the_package_never_unpickles_a_file():
    files = package_files()
    assert len(files) > 50 and any(p.name == "lightning.py" for p in files)  # the scan sees the package
    bad, allowed_seen = [], set()
    for path in files:
        rel = str(path.relative_to(ROOT))
        for line, func, what in violations(path.read_text(), rel):
            if (rel, func) in ALLOWED:
                allowed_seen.add((rel, func))
                continue
            bad.append(f"{rel}:{line} in {func}: {what}")
    assert not bad, "unpickling outside torch's weights_only loader:\n" + "\n".join(bad)
    stale = set(ALLOWED) - allowed_seen
    assert not stale, f"allowlist entries that no longer match anything: {stale}"


@pytest.mark.parametrize("rel", ["integrations/lightning.py", "integrations/transformers.py"])
def test_the_trainers_load_through_weights_only(rel):
    """The trainers do load torch files (so the rule above is exercised there, not vacuous)."""
    tree = ast.parse((ROOT / rel).read_text())
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _dotted(n.func) == "torch.load"]
    assert loads and all(_is_const({k.arg: k.value for k in n.keywords}.get("weights_only"), True) for n in loads)
