"""The ``polyaccel`` command. Subcommands live in their own modules and load lazily."""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> (module under polyaccel.cli, one-line help)
SUBCOMMANDS = {
    "report": ("report_cmd", "show versions, plugins and why each is (un)usable, capabilities and op choices"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyaccel",
        description=(
            "polyaccel: plugin-based hardware abstraction for PyTorch training. "
            "Backends are entry-point plugins; see `polyaccel report` for what is installed."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        mod = importlib.import_module(f"{__name__}.{module}")
        p = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
