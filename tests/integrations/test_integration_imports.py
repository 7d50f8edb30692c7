"""The integrations are optional: `import polyaccel` (and `polyaccel.integrations`) imports none of them or their
frameworks, and they reach the engine through polyaccel.initialize only."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_polyaccel_loads_no_integration_or_framework():
    code = ("import sys, polyaccel, polyaccel.integrations\n"
            "polyaccel.get_accelerator()\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'lightning', 'pytorch_lightning', "
            "'transformers', 'accelerate') or m.startswith('polyaccel.integrations.')]\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_integrations_import_no_engine_module():
    bad = []
    for path in (ROOT / "integrations").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [(path.name, n) for n in names if n.startswith(("polyaccel.engines", "polyaccel.plugins"))]
    assert not bad, bad
