"""The ``polyaccel`` command.

Core subcommands live in modules of this package (``SUBCOMMANDS``); engines and plugins add
theirs through the entry-point group ``polyaccel.commands`` (name -> module). A subcommand
module has a docstring (its ``--help`` text), ``HELP`` (one line), ``add_arguments(parser)``
and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import sys

COMMAND_GROUP = "polyaccel.commands"
#: set to 1 to let a command's unexpected exception end in its traceback (by default: one line, exit status 1)
TRACEBACK_ENV = "POLYACCEL_TRACEBACK"

#: core subcommand -> (module under polyaccel.cli, one-line help)
SUBCOMMANDS = {
    "report": ("report_cmd", "show versions, plugins and why each is (un)usable, capabilities and op choices"),
    "conformance": ("conformance_cmd", "run the conformance suite against an accelerator plugin"),
}


def _command_modules():
    for name, (module, help_) in SUBCOMMANDS.items():
        yield name, (lambda module=module: importlib.import_module(f"{__name__}.{module}")), help_
    for ep in md.entry_points(group=COMMAND_GROUP):
        if ep.name not in SUBCOMMANDS:
            yield ep.name, ep.load, None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyaccel",
        description=(
            "polyaccel: plugin-based hardware abstraction for PyTorch training. "
            "Backends are entry-point plugins; see `polyaccel report` for what is installed."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, load, help_ in _command_modules():
        try:
            mod = load()
        except Exception as exc:  # noqa: BLE001 - one broken command must not break the others
            p = sub.add_parser(name, help=f"(unavailable: {type(exc).__name__}: {exc})")
            p.set_defaults(_run=lambda args, name=name, exc=exc: _broken(name, exc))
            continue
        help_ = help_ or getattr(mod, "HELP", "")
        p = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _broken(name: str, exc: Exception) -> int:
    print(f"polyaccel {name}: this command could not be loaded: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(f"polyaccel {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a command's unexpected error: one line, not a traceback
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        from polyaccel.errors import PolyaccelError

        what = str(exc) if isinstance(exc, PolyaccelError) else f"{type(exc).__name__}: {exc}"
        print(f"polyaccel {args.command}: {what.strip().splitlines()[0] if what.strip() else type(exc).__name__} "
              f"(set {TRACEBACK_ENV}=1 to see where it was raised)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
