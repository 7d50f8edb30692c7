"""Print the op reference (signatures and semantics) that docs/plugin-authoring.md carries."""

from . import op_reference_markdown

print(op_reference_markdown(), end="")
