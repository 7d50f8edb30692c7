"""Import rules of the core and the plugins: no module imports, even inside a function, one that imports
it back (within the core, within a plugin, or through the core); the core imports no plugin; selection,
ops and comm reach each other's state only through the runtime; every module imports first in a fresh
interpreter (no half-initialised module on any import order); importing the contracts builds no state.

Each checker is first run on a small package built to break the rule, so a checker that stopped
seeing cycles would fail here instead of passing silently.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_names(folder: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module under ``folder`` (the package ``package``)."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def import_graph(folder: Path, package: str, *more: tuple[Path, str]) -> dict[str, set[str]]:
    """Module -> the modules of the package (and of the ``more`` (folder, package) pairs) it imports.

    Every import statement counts: at module level, inside a function or a method, under ``if``
    or ``try``. ``from pkg import name`` counts as an import of ``pkg.name`` when that is a
    module, else of ``pkg``. The parent packages Python initialises on the way are not edges
    (``a.b`` importing ``a.c`` would otherwise always close a cycle through ``a``); the
    fresh-interpreter check below covers what they do to the import order.
    """
    modules = module_names(folder, package)
    for other_folder, other_package in more:
        modules.update(module_names(other_folder, other_package))
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = own_package.split(".")[: len(own_package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


FRESH_IMPORTS = textwrap.dedent('''
    import importlib, json, sys
    package, names = sys.argv[1], json.loads(sys.argv[2])
    failures, skipped = {}, {}
    for name in names:
        for loaded in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[loaded]
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] != package:
                skipped[name] = exc.name  # an optional third-party dependency, not an import-order problem
            else:
                failures[name] = f"{type(exc).__name__}: {exc}"
        except BaseException as exc:
            failures[name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"failures": failures, "skipped": skipped}))
''')


def fresh_import_failures(package: str, names: list[str], path: Path | None = None) -> dict:
    """Import each module first, with no module of ``package`` loaded: module -> error, and the skipped."""
    env = {"PATH": "", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    if path is not None:
        env["PYTHONPATH"] = str(path)
    out = subprocess.run([sys.executable, "-c", FRESH_IMPORTS, package, json.dumps(names)], capture_output=True,
                         text=True, check=True, env=env, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        target = tmp_path / "cyc" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(source))
    return tmp_path / "cyc"


# ------------------------------------------------------------------- the checkers can fail
def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    """The shape selection <-> ops used to have: one side imports at module level, the other lazily."""
    folder = _package(tmp_path, {
        "__init__.py": "",
        "selection.py": "def reset():\n    from . import ops\n    ops.registry.reset()\n",
        "ops/__init__.py": "from ..selection import reset\n",
        "ops/registry.py": "",
        "comm/__init__.py": "def refresh():\n    from . import tracing\n",
        "comm/tracing.py": "from . import refresh\n",
    })
    assert cycles(import_graph(folder, "cyc")) == [["cyc.comm", "cyc.comm.tracing"], ["cyc.ops", "cyc.selection"]]


def test_a_half_initialised_module_is_found(tmp_path):
    """``runtime`` importing ``ops.registry`` runs ``ops/__init__``, which wants a name runtime defines later."""
    folder = _package(tmp_path, {
        "__init__.py": "",
        "runtime.py": "from .ops.registry import Registry\n\ndef current():\n    return None\n",
        "ops/__init__.py": "from ..runtime import current\n",
        "ops/registry.py": "class Registry:\n    pass\n",
    })
    assert cycles(import_graph(folder, "cyc")) == []  # statically fine: only the import order breaks it
    result = fresh_import_failures("cyc", ["cyc.runtime", "cyc.ops"], path=folder.parent)
    assert list(result["failures"]) == ["cyc.runtime"]
    assert "partially initialized module 'cyc.runtime'" in result["failures"]["cyc.runtime"]


def test_a_cycle_between_plugin_modules_through_a_method_level_import_is_found(tmp_path):
    """The shape the cuda kernels had: a module-level import one way, an import inside a property back."""
    folder = _package(tmp_path, {
        "__init__.py": "",
        "plugins/__init__.py": "",
        "plugins/gpu/__init__.py": "def hook():\n    from .ops import builders\n    return builders()\n",
        "plugins/gpu/ops.py": "from cyc.core import Builder\n\ndef builders():\n    return []\n",
        "plugins/gpu/kernels/__init__.py": "",
        "plugins/gpu/kernels/table.py": ("class Group:\n    @property\n    def dtypes(self):\n"
                                         "        from .optimizers import DTYPES\n        return DTYPES\n"),
        "plugins/gpu/kernels/optimizers.py": "from .table import Group\nDTYPES = {}\n",
        "core.py": "class Builder:\n    pass\n",
    })
    graph = import_graph(folder / "plugins", "cyc.plugins", (folder, "cyc"))
    assert cycles(graph) == [["cyc.plugins.gpu.kernels.optimizers", "cyc.plugins.gpu.kernels.table"]]
    assert "cyc.core" in graph["cyc.plugins.gpu.ops"]  # edges into the other package are followed too


# ------------------------------------------------------------------- the core keeps the rules
def test_the_core_has_no_import_cycle():
    assert cycles(import_graph(ROOT / "core", "polyaccel")) == []
    assert cycles(import_graph(ROOT / "integrations", "polyaccel.integrations")) == []


def test_selection_ops_and_comm_meet_only_through_the_runtime():
    graph = import_graph(ROOT / "core", "polyaccel")
    families = {"selection": ("polyaccel.selection",), "ops": ("polyaccel.ops",), "comm": ("polyaccel.comm",)}

    def family(module: str) -> str | None:
        for name, prefixes in families.items():
            if any(module == p or module.startswith(p + ".") for p in prefixes):
                return name
        return None

    crossing = sorted((m, t) for m, targets in graph.items() for t in targets
                      if family(m) and family(t) and family(m) != family(t))
    assert crossing == []
    for name in families:
        reach = set().union(*(graph[m] for m in graph if family(m) == name))
        assert "polyaccel.runtime" in reach, f"{name} should reach the process state through polyaccel.runtime"
    # the runtime sits below them: it imports none of selection, comm, report or the ops front end
    assert not {t for t in graph["polyaccel.runtime"]
                if family(t) in ("selection", "comm") or t in ("polyaccel.ops", "polyaccel.report")}


def test_every_core_module_imports_first_in_a_fresh_interpreter():
    modules = {**module_names(ROOT / "core", "polyaccel"),
               **module_names(ROOT / "integrations", "polyaccel.integrations")}
    names = [n for n in modules if not n.endswith("__main__")]
    result = fresh_import_failures("polyaccel", names)
    assert result["failures"] == {}
    # DeepSpeed is an optional extra: only the module subclassing its classes needs it at import
    assert set(result["skipped"]) <= {"polyaccel.integrations._deepspeed_classes"}, result["skipped"]


# ------------------------------------------------------------------- and so do the plugins
def _core_and_plugins_graph() -> dict[str, set[str]]:
    return import_graph(ROOT / "plugins", "polyaccel.plugins", (ROOT / "core", "polyaccel"))


def test_no_plugin_has_an_import_cycle_even_through_the_core():
    graph = _core_and_plugins_graph()
    assert any(t.startswith("polyaccel.plugins.") for t in graph["polyaccel.plugins.rocm.accelerator"])
    assert cycles(graph) == []


def test_the_core_imports_no_plugin():
    graph = _core_and_plugins_graph()
    assert sorted((m, t) for m, targets in graph.items() if not m.startswith("polyaccel.plugins")
                  for t in targets if t.startswith("polyaccel.plugins")) == []


def test_every_plugin_module_imports_first_in_a_fresh_interpreter():
    names = list(module_names(ROOT / "plugins", "polyaccel.plugins"))
    result = fresh_import_failures("polyaccel", names)
    assert result["failures"] == {}
    assert set(result["skipped"]) <= {n for n in names if n.startswith("polyaccel.plugins.cuda.kernels.")}, \
        result["skipped"]


NO_STATE_AT_IMPORT = textwrap.dedent('''
    import json
    import polyaccel.ops, polyaccel.comm, polyaccel.accelerator, polyaccel.comm_hooks
    from polyaccel.ops import OpRegistry
    from polyaccel.runtime import current
    rt = current()
    made = sorted(k for k, v in vars(rt).items() if isinstance(v, OpRegistry))
    print(json.dumps({"registries": made, "discovered": rt.discovered, "selected": rt.selected is not None}))
''')


def test_importing_the_contracts_builds_no_process_state():
    """polyaccel.ops, polyaccel.comm and the contracts import without making the op registry or discovering."""
    out = subprocess.run([sys.executable, "-c", NO_STATE_AT_IMPORT], capture_output=True, text=True, check=True,
                         env={"PATH": "", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, timeout=300)
    state = json.loads(out.stdout.strip().splitlines()[-1])
    assert state == {"registries": [], "discovered": False, "selected": False}
