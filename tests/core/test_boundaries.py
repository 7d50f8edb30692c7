"""Architecture rules: core imports neither plugins, engines nor apps; plugins only core; engines no plugins;
apps (``polyaccel train``) core and engines only; import is light."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(folder: Path):
    for path in folder.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        pkg_parts = ("polyaccel." + ".".join(path.relative_to(ROOT).with_suffix("").parts[1:])).split(".")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    yield path, a.name
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg_parts[: len(pkg_parts) - node.level]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                yield path, name


def test_core_imports_neither_plugins_nor_engines():
    bad = [(str(p), m) for folder in ("core", "integrations") for p, m in imported_modules(ROOT / folder)
           if m.startswith(("polyaccel.plugins", "polyaccel.engines", "polyaccel.apps"))]
    assert not bad, bad


def test_engines_import_core_only():
    bad = [(str(p), m) for p, m in imported_modules(ROOT / "engines")
           if m.startswith(("polyaccel.plugins", "polyaccel.apps"))]
    assert not bad, bad


def test_apps_import_core_and_engines_only():
    bad = [(str(p), m) for p, m in imported_modules(ROOT / "apps") if m.startswith("polyaccel.plugins")]
    assert not bad, bad


def engine_exports(engine: str) -> set[str]:
    """The names in ``engines/<engine>/__init__.py``'s ``__all__`` (read from the source, not imported)."""
    for node in ast.parse((ROOT / "engines" / engine / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def private_engine_imports(source: str, exports=engine_exports) -> list[str]:
    """What ``source`` imports of an engine besides the names its package exports: a module inside an
    engine package (``polyaccel.engines.zero.checkpoint``, ``polyaccel.engines.zero._x``), or a name not in
    the package's ``__all__``."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.startswith("polyaccel.engines.")
                    and len(a.name.split(".")) > 3]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("polyaccel.engines"):
            parts = node.module.split(".")
            if len(parts) != 3:
                bad.append(node.module)
                continue
            bad += [f"{node.module}.{a.name}" for a in node.names if a.name not in exports(parts[2])]
    return bad


def test_private_engine_import_checker_sees_modules_and_unexported_names():
    source = ("from polyaccel.engines.zero.checkpoint import run_id\nimport polyaccel.engines.zero._x\n"
              "from polyaccel.engines.zero import ZeroEngine, _hidden\nfrom polyaccel.engines import zero\n")
    assert sorted(private_engine_imports(source, lambda e: {"ZeroEngine"})) == [
        "polyaccel.engines", "polyaccel.engines.zero._hidden", "polyaccel.engines.zero._x",
        "polyaccel.engines.zero.checkpoint"]


def test_apps_use_only_what_engine_packages_export():
    """``apps/`` reaches an engine through its package's ``__all__`` (or the core), never its modules."""
    bad = [f"{path.relative_to(ROOT)}: {m}" for path in sorted((ROOT / "apps").rglob("*.py"))
           for m in private_engine_imports(path.read_text())]
    assert not bad, "apps/ import engine internals; export them from the engine package or the core:\n" + \
        "\n".join(bad)


def test_plugins_import_no_other_plugin_except_rocm_reusing_cuda():
    bad = []
    for plugin_dir in (ROOT / "plugins").iterdir():
        if not plugin_dir.is_dir() or plugin_dir.name.startswith("_"):
            continue
        allowed = {f"polyaccel.plugins.{plugin_dir.name}"}
        if plugin_dir.name == "rocm":
            allowed.add("polyaccel.plugins.cuda")
        for p, m in imported_modules(plugin_dir):
            if m.startswith("polyaccel.engines") or (
                    m.startswith("polyaccel.plugins.") and not any(m.startswith(a) for a in allowed)):
                bad.append((str(p), m))
    assert not bad, bad


def test_import_and_selection_load_no_triton_vendor_runtime_or_engine():
    code = (
        "import sys, json, polyaccel\n"
        "light = [m for m in ('torch', 'triton', 'transformers') if m in sys.modules]\n"
        "polyaccel.get_accelerator()\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('triton', 'torch_npu', 'torch_supa',"
        " 'intel_extension_for_pytorch', 'transformers') or m.startswith(('polyaccel.engines', 'polyaccel.apps'))]\n"
        "print(json.dumps({'light': light, 'heavy': heavy}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["light"] == [], "import polyaccel must not import torch or triton by itself"
    assert res["heavy"] == [], res["heavy"]


# ------------------------------------------------------------------- the core names no backend
IN_TREE_PLUGINS = ("cpu", "cuda", "rocm", "npu", "xpu", "mps", "supa")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")  # "CUDAGraph" -> CUDA, Graph; "torch_npu" -> torch, npu
_PLUGIN_REFERENCE = re.compile(r"polyaccel\[([\w,\s]+)\]|polyaccel\.plugins\.(\w+)")

#: names another library defines, which polyaccel must spell as that library does: (path, fragment) -> why
FOREIGN_API_NAMES = {
    ("integrations/deepspeed.py", "CUDAOpBuilder"):
        "DeepSpeed's base class of its op builders: skipped, not named as a backend, when rebinding DeepSpeed's",
}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """Every bare string statement (module, class, function and attribute docstrings)."""
    bodies = [node.body for node in ast.walk(tree) if isinstance(getattr(node, "body", None), list)]
    return {id(st.value) for body in bodies for st in body
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str)}


def _code_texts(tree: ast.AST):
    """(line, text) of every identifier, attribute, import path and string literal that is code."""
    skip = _docstring_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.value.lineno, node.arg
        elif isinstance(node, ast.alias):
            yield node.lineno, node.asname or node.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module


def _plugin_names_in(text: str) -> list[str]:
    """The in-tree plugin names ``text`` uses; the host's device type ("cpu") counts only where it names the plugin."""
    words = {w.lower() for w in _WORD.findall(text)}
    named = {n for n in IN_TREE_PLUGINS if n != "cpu" and n in words}
    for extras, module in _PLUGIN_REFERENCE.findall(text):
        named |= {n for n in re.split(r"[,\s]+", extras or module) if n in IN_TREE_PLUGINS}
    return sorted(named)


def _listed(table: dict[tuple[str, str], str], path: str, text: str) -> tuple[str, str] | None:
    """The entry of ``table`` for ``path`` whose fragment ``text`` contains, if any."""
    return next((key for key in table if key[0] == path and key[1] in text), None)


def backend_names_in_code(source: str) -> list[tuple[int, str, list[str]]]:
    return sorted((line, text, names) for line, text in _code_texts(ast.parse(source))
                  if (names := _plugin_names_in(text)))


def test_the_backend_name_check_sees_code_and_ignores_docstrings_and_comments():
    source = '''
"""Module docstring: cuda, npu and mps may be named here, to explain the rule."""
import torch
from torch_npu import npurt  # a comment may name xpu


class Thing:
    """Class docstring: supa."""

    def run(self, t):
        if torch.cuda.is_available():
            return t.to("mps")
        graph = self.module().CUDAGraph()
        host = t.cpu() if t.device.type != "cpu" else t
        raise RuntimeError("install polyaccel[cpu] or a rocm build")
'''
    found = {text: names for _, text, names in backend_names_in_code(source)}
    assert found == {"torch_npu": ["npu"], "cuda": ["cuda"], "mps": ["mps"], "CUDAGraph": ["cuda"],
                     "install polyaccel[cpu] or a rocm build": ["cpu", "rocm"]}


def test_core_names_no_in_tree_plugin():
    """``core/`` names no in-tree plugin (cpu, cuda, rocm, npu, xpu, mps, supa) in its code.

    What counts: identifiers, attribute names, import paths and string literals, split into
    words (``CUDAGraph`` and ``torch_npu`` name cuda and npu). What is allowed, and why:

    - docstrings and comments: they may name backends to explain the rule or give examples;
    - "cpu" as torch's name for the host (``"cpu"``, ``.cpu()``, "host (cpu) tensor"): the host
      is there under every backend, and the core must handle host memory (staging, pinning,
      host-backed accelerators). "cpu" counts where it names the plugin: the ``polyaccel[cpu]``
      extra or the ``polyaccel.plugins.cpu`` package;
    - :data:`FOREIGN_API_NAMES`: names another library defines and polyaccel must spell as it
      does, each with the reason.

    torch's own backend names get no exemption: ``torch.cuda``, ``torch.mps`` and the device
    type strings "cuda", "xpu" ... name a backend, and the core reaches devices through the
    selected accelerator and torch's device-generic APIs (``torch.get_device_module(device_type)``,
    ``torch.accelerator``).
    """
    found: list[str] = []
    for path in sorted([*(ROOT / "core").rglob("*.py"), *(ROOT / "integrations").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for line, text, names in backend_names_in_code(path.read_text()):
            if _listed(FOREIGN_API_NAMES, rel, text) is None:
                found.append(f"{rel}:{line} {text!r} names {', '.join(names)}")
    assert not found, "core/ names in-tree plugins in code:\n" + "\n".join(found)
