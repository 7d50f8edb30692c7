"""The ``polyaccel`` command.

Core subcommands live in modules of this package (``SUBCOMMANDS``); engines and plugins add
theirs through the entry-point group ``polyaccel.commands`` (name -> module). A subcommand
module has a docstring (its ``--help`` text), ``HELP`` (one line), ``add_arguments(parser)``
and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.metadata as md
import os
import re
import sys

COMMAND_GROUP = "polyaccel.commands"
#: set to 1 to let a command's unexpected exception end in its traceback (by default: one line, exit status 1)
TRACEBACK_ENV = "POLYACCEL_TRACEBACK"

#: core subcommand -> (module under polyaccel.cli, one-line help)
SUBCOMMANDS = {
    "report": ("report_cmd",
               "show versions, plugins and why each is (un)usable, capabilities and op choices"),
    "conformance": ("conformance_cmd", "run the conformance suite against an accelerator plugin"),
}


def _command_modules():
    for name, (module, help_) in SUBCOMMANDS.items():
        yield name, (lambda module=module: importlib.import_module(f"{__name__}.{module}")), help_
    for ep in md.entry_points(group=COMMAND_GROUP):
        if ep.name not in SUBCOMMANDS:
            yield ep.name, ep.load, None


class CommandParser(argparse.ArgumentParser):
    """The parser of ``polyaccel`` and of every sub-command (argparse gives sub-parsers their parent's class).

    A sub-command refuses arguments it does not know itself, so the error shows that sub-command's usage line
    (argparse would hand them to the top-level parser, whose usage names no option of the sub-command), and an
    unknown option comes with the nearest option the parser has ("did you mean --steps?")."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self.prog != _PROG:  # a sub-command's parser: its own error, with its own usage
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str):
        super().error(message + did_you_mean(message, self))


_PROG = "polyaccel"
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


def did_you_mean(message: str, parser: argparse.ArgumentParser) -> str:
    """The nearest known spelling of each unknown option (or sub-command) ``message`` names, as a sentence to
    append to the error; "" when nothing is close."""
    hints: list[tuple[str, str]] = []  # (what was typed, the nearest known spelling)
    unknown = _UNRECOGNIZED.search(message)
    if unknown:
        options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
        for arg in unknown.group(1).split():
            if arg.startswith("-"):
                hints += [(arg, m) for m in difflib.get_close_matches(arg.split("=", 1)[0], options, n=1)]
    choice = _INVALID_CHOICE.search(message)
    if choice:
        choices = [c.strip().strip("'") for c in choice.group(2).split(",")]
        hints += [(choice.group(1), m) for m in difflib.get_close_matches(choice.group(1), choices, n=1)]
    if len(hints) == 1:
        return f"; did you mean {hints[0][1]}?"
    return "; did you mean " + ", ".join(f"{m} (for {typed})" for typed, m in hints) + "?" if hints else ""


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog=_PROG,
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
        first = what.strip().splitlines()[0] if what.strip() else type(exc).__name__
        print(f"polyaccel {args.command}: {first} (set {TRACEBACK_ENV}=1 to see where it was raised)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
