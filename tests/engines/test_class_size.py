"""No class in engines/ over 300 lines: a class that long is doing several jobs (split it into parts the owner
composes, as the ZeRO engine and stage 3 are), and a reader cannot hold it in one sitting."""

import ast
from pathlib import Path

ENGINES = Path(__file__).resolve().parents[2] / "engines"
MAX_LINES = 300


def long_classes(folder: Path, limit: int) -> list[str]:
    """``path:line Class (n lines)`` for every class of more than ``limit`` lines under ``folder``, nested
    ones included."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    where = f"{path.relative_to(folder.parent)}:{node.lineno}"
                    found.append(f"{where} {node.name} ({lines} lines)")
    return found


def test_no_engine_class_is_over_300_lines():
    assert long_classes(ENGINES, MAX_LINES) == []


def test_the_check_sees_a_long_class(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text(f"class Short:\n    pass\n\n\nclass Long:\n{body}\n")
    assert long_classes(tmp_path / "pkg", MAX_LINES) == [f"pkg/long.py:5 Long ({MAX_LINES + 1} lines)"]
