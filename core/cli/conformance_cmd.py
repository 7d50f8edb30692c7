"""Certify an accelerator plugin: run the conformance suite and print one row per check.

Rows are grouped by area (device, capability, op, comm). Each row is PASS, FAIL (with
the reason), UNSUPPORTED (the plugin does not claim the capability and raises
polyaccel.Unsupported, as it must) or SKIPPED (with the reason). Rows produced under an
emulated runtime are labelled "emulated". Exit status: 0 when nothing failed, 1 when a
check failed, 2 when the suite could not run (unknown accelerator, no emulated runtime,
nothing matched -k).

The accelerator is --accelerator NAME, else $POLYACCEL_ACCELERATOR, else the one polyaccel
selects by itself. --emulate runs inside the emulated runtime a plugin offers for NAME
(hook polyaccel_emulated_runtimes).
The --json document is stable and documented in docs/conformance-json.md.

--workers N runs the checks in N pytest-xdist processes (default: $POLYACCEL_CONFORMANCE_WORKERS,
else one per 4 host CPUs, at most 4): on a GPU with an empty kernel cache a run is mostly
compiling, which then happens in parallel. The rows and the document do not depend on N.

--fuzz adds the op-contract fuzz rows (check "fuzz"), one per op and builder serving the
device type, the core reference included: hypothesis draws cases (shapes with zero-size and
odd sides, transposed / stepped / offset layouts with different strides per tensor, every
supported dtype, NaN and Inf in optimizer gradients and quantizer inputs, bad hyperparameters,
overlapping written tensors) and calls polyaccel.ops.<op> with the builder forced. A case
passes when the result equals the reference (computed on float64 copies) within the dtype's
tolerance, NaN where it has NaN, or when the call raises OpArgumentError leaving every input
unchanged. A failing row names the builder and the minimal (shrunk) case: shapes, strides,
offsets, dtypes and the seed of the values. --fuzz-examples N draws N cases per row (default
25, the CI budget); without --fuzz-seed the cases are a fixed, derandomized set, so two runs
agree; --fuzz-seed S draws another fixed set. Needs hypothesis (`pip install polyaccel[conformance]`).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys

from ..errors import ConfigError

HELP = "run the conformance suite against an accelerator plugin (PASS / FAIL / UNSUPPORTED / SKIPPED)"

_STYLE = {"PASS": "green", "FAIL": "bold red", "UNSUPPORTED": "cyan", "SKIPPED": "yellow"}
_LABEL = {"UNSUPPORTED": "UNSUPPORTED-verified"}
_AREA_ORDER = ("suite", "device", "capability", "op", "comm")
NO_TESTS = 5  # pytest's exit status when nothing was collected or everything was deselected


def add_arguments(p) -> None:
    p.add_argument("--accelerator", metavar="NAME", default=None,
                   help="plugin to certify (default: $POLYACCEL_ACCELERATOR, else the auto-selected one)")
    p.add_argument("--emulate", action="store_true",
                   help="run inside the emulated runtime a plugin offers for NAME "
                        "(polyaccel_emulated_runtimes)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the result document to FILE")
    p.add_argument("--junitxml", metavar="FILE", default=None, help="also write JUnit XML to FILE")
    p.add_argument("-k", dest="keyword", metavar="EXPR", default=None,
                   help="only run checks matching the pytest keyword expression EXPR")
    p.add_argument("-v", "--verbose", action="store_true", help="also print pytest's own output")
    p.add_argument("--timeout", type=float, default=900.0, metavar="S",
                   help="give up after S seconds (900), naming the check it was on")
    p.add_argument("--workers", type=_workers, default=None, metavar="N",
                   help="run the checks in N pytest-xdist processes (a cold GPU compiles its kernels in "
                        "parallel; 0 or 1: one process). Default: $POLYACCEL_CONFORMANCE_WORKERS, else one per "
                        "4 host CPUs, at most 4 (1 without pytest-xdist)")
    p.add_argument("--fuzz", action="store_true",
                   help="also run the op-contract fuzz rows: drawn shapes, strides, offsets, dtypes, NaN/Inf "
                        "for every builder of every op, vs the reference (needs hypothesis)")
    p.add_argument("--fuzz-examples", type=int, default=None, metavar="N",
                   help="with --fuzz: drawn cases per (op, builder) row (default 25)")
    p.add_argument("--fuzz-seed", type=int, default=None, metavar="S",
                   help="with --fuzz: draw the cases from seed S (default: a fixed, derandomized set)")


def run(args) -> int:
    import importlib.util

    from ..testing.conformance.runner import run_suite

    if importlib.util.find_spec("pytest") is None:
        print("polyaccel conformance: the suite runs on pytest, which is not installed here; "
              "install it with `pip install polyaccel[conformance]` (or `pip install pytest`)", file=sys.stderr)
        return 2

    if not args.fuzz and (args.fuzz_examples is not None or args.fuzz_seed is not None):
        given = "--fuzz-examples" if args.fuzz_examples is not None else "--fuzz-seed"
        print(f"polyaccel conformance: {given} applies to the fuzz rows; add --fuzz", file=sys.stderr)
        return 2
    if args.fuzz_examples is not None and args.fuzz_examples < 1:
        print(f"polyaccel conformance: --fuzz-examples must be at least 1, got {args.fuzz_examples}",
              file=sys.stderr)
        return 2
    if args.fuzz and importlib.util.find_spec("hypothesis") is None:
        print("polyaccel conformance: --fuzz draws its cases with hypothesis, which is not installed here; "
              "install it with `pip install polyaccel[conformance]` (or `pip install hypothesis`)", file=sys.stderr)
        return 2
    try:
        with _progress_shown() as show:
            result = run_suite(args.accelerator, emulate=args.emulate, keyword=args.keyword,
                               junitxml=args.junitxml, json_path=args.json, verbose=args.verbose,
                               timeout=args.timeout, fuzz=args.fuzz, fuzz_examples=args.fuzz_examples,
                               fuzz_seed=args.fuzz_seed, progress=show, workers=args.workers)
    except ConfigError as exc:
        print(f"polyaccel conformance: {exc}", file=sys.stderr)
        return 2
    except TimeoutError as exc:
        print(f"polyaccel conformance: {exc}", file=sys.stderr)
        return 2
    if args.verbose:
        print(result.output)
    doc = result.document
    error = result.error()
    if doc is not None and doc["rows"]:
        _print_table(doc)
    if doc is not None and doc.get("exit_status") == NO_TESTS and not doc["rows"]:
        matched = f" (nothing matched -k {args.keyword!r})" if args.keyword else ""
        print(f"polyaccel conformance: no check ran{matched}", file=sys.stderr)
        return 2
    if error:
        print(f"polyaccel conformance: {error}", file=sys.stderr)
        return 2
    return 0 if doc["ok"] else 1


def _workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of processes") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} processes: give 0 or more (0 and 1: one process)")
    return n


@contextlib.contextmanager
def _progress_shown():
    """A progress bar on a terminal's stderr (checks done of those collected, the one running), gone when the
    run ends; elsewhere (a pipe, a log) nothing until the table."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("conformance"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("collecting", total=None)

        def show(run) -> None:
            check = (run.running or "").rsplit("/", 1)[-1]
            bar.update(task, total=run.total, completed=run.done, description=check)

        yield show


def _print_table(doc) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # a terminal gets its own width; a pipe or log file gets wide rows rather than folded words
    width = shutil.get_terminal_size((140, 24)).columns if sys.stdout.isatty() else 220
    con = Console(width=max(100, width))
    acc = doc["accelerator"] or {}
    emulated = bool(acc.get("emulated"))
    claims = ", ".join(acc.get("capabilities") or []) or "nothing"
    title = (f"conformance of {acc.get('name', '?')!r} (device type {acc.get('device_type', '?')}"
             f"{', emulated' if emulated else ''}); claims: {claims}")
    rows = sorted(doc["rows"],
                  key=lambda r: (_AREA_ORDER.index(r["area"]) if r["area"] in _AREA_ORDER else 99))
    table = Table(title=title, show_lines=False)
    for col in ("area", "subject", "check", "claimed", "result", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        status = _LABEL.get(r["status"], r["status"])
        if r.get("emulated"):
            status += " (emulated)"
        claimed = "-" if r.get("claimed") is None else ("yes" if r["claimed"] else "no")
        check = r["check"] + (f" [{r['variant']}]" if r.get("variant") else "")
        table.add_row(escape(r["area"]), escape(r["subject"]), escape(check), claimed,
                      f"[{_STYLE.get(r['status'], 'white')}]{status}[/]", escape(r.get("reason") or ""))
    con.print(table)
    counts = doc["counts"]
    verdict = "[bold green]CONFORMS[/]" if doc["ok"] else "[bold red]DOES NOT CONFORM[/]"
    con.print(f"{verdict}: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['UNSUPPORTED']} "
              f"unsupported (verified), {counts['SKIPPED']} skipped in {doc['duration_s']:.1f} s")
