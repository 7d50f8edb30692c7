"""Show what polyaccel found on this machine.

Lists versions, every plugin discovered through the `polyaccel.plugins` entry points
with its status (selected / available / unavailable / loaded / failed / blocked /
incompatible / duplicate) and the reason, the selected accelerator's capabilities,
and for every op the builder chosen for that device (--verbose: and why, and why not
each other builder). A plugin whose op hook raised (or gave unusable builders) is
listed as failed, with the error and the builders that were dropped.

Environment: POLYACCEL_ACCELERATOR, POLYACCEL_PLUGINS, POLYACCEL_DISABLE_PLUGINS,
POLYACCEL_DISABLE_PLUGIN_AUTOLOAD, POLYACCEL_OP_OVERRIDES (see the README).
"""

from __future__ import annotations

import json

from .report_text import report_lines


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema in docs/report.md)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="say why each op's builder was chosen and why each other builder was not")


def run(args) -> int:
    from ..report import build_report

    rep = build_report()
    if args.json:
        print(json.dumps(rep, indent=2, sort_keys=True, default=str))
    else:
        _print(report_lines(rep, verbose=args.verbose))
    return 0 if rep["selected"] else 1


def _print(lines) -> None:
    """The lines as laid out (rich adds the colours on a terminal and wraps nothing itself)."""
    from rich.console import Console
    from rich.text import Text

    con = Console(soft_wrap=True, highlight=False)
    for line in lines:
        text = Text(line.text)
        for start, end, style in line.styles:
            text.stylize(style, start, end)
        con.print(text)
