"""Architecture rules: core imports neither plugins, engines nor apps; plugins only core; engines no plugins;
apps (``polyaccel train``) core and engines only; import is light."""

import ast
import json
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
    bad = [(str(p), m) for p, m in imported_modules(ROOT / "core")
           if m.startswith(("polyaccel.plugins", "polyaccel.engines", "polyaccel.apps"))]
    assert not bad, bad


def test_engines_import_core_only():
    bad = [(str(p), m) for p, m in imported_modules(ROOT / "engines")
           if m.startswith(("polyaccel.plugins", "polyaccel.apps"))]
    assert not bad, bad


def test_apps_import_core_and_engines_only():
    bad = [(str(p), m) for p, m in imported_modules(ROOT / "apps") if m.startswith("polyaccel.plugins")]
    assert not bad, bad


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
