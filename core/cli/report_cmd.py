"""Show what polyaccel found on this machine.

Lists versions, every plugin discovered through the `polyaccel.plugins` entry points
with its status (selected / available / unavailable / loaded / failed / blocked /
incompatible / duplicate) and the reason, the selected accelerator's capabilities,
and for every op the builder chosen for that device and why. A plugin whose op hook
raised (or gave unusable builders) is listed as failed, with the error and the
builders that were dropped.

Environment: POLYACCEL_ACCELERATOR, POLYACCEL_PLUGINS, POLYACCEL_DISABLE_PLUGINS,
POLYACCEL_DISABLE_PLUGIN_AUTOLOAD, POLYACCEL_OP_OVERRIDES (see the README).
"""

from __future__ import annotations

import json


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema in docs/report.md)")


def run(args) -> int:
    from ..report import build_report

    rep = build_report()
    if args.json:
        print(json.dumps(rep, indent=2, sort_keys=True, default=str))
        return 0 if rep["selected"] else 1
    _print_rich(rep)
    _print_extensions(rep)
    return 0 if rep["selected"] else 1


def _print_extensions(rep) -> None:
    """The engines and model layers, each loaded or isolated with the reason."""
    from rich.console import Console
    from rich.markup import escape

    con = Console()
    for title, key in (("engines", "engines"), ("model layers", "layers")):
        rows = rep.get(key) or []
        shown = ", ".join(f"{escape(r['name'])}" + ("" if r["status"] == "loaded" else f" [red]{r['status']}[/]")
                          for r in rows)
        con.print(f"{title}: {shown or 'none'}")
        for r in rows:
            if r["status"] != "loaded":
                con.print(f"  [red]{escape(r['name'])} {r['status']}[/]: {escape(r['reason'])} ({escape(r['source'])})")


def _print_rich(rep) -> None:
    from rich.console import Console
    from rich.markup import escape

    con = Console()
    v = rep["versions"]
    con.print("[bold]polyaccel report[/bold]  " + "  ".join(f"{k} {v[k] or '-'}" for k in v))
    con.print(_plugins_table(rep["plugins"]))
    for name, info in (rep.get("op_registration_errors") or {}).items():
        dropped = ", ".join(info["dropped_builders"]) or "none"
        con.print(f"[red]op builders of {escape(name)} ignored[/]: {escape(info['reason'])} "
                  f"(dropped: {escape(dropped)})")
    sel = rep["selected"]
    if sel is None:
        con.print(f"[bold red]no accelerator selected[/]: {rep['selection_error']}")
        return
    _print_selected(con, sel)
    con.print(_ops_table(sel["device_type"], rep["ops"]))
    for name, extra in rep["extra"].items():
        con.print(f"[bold]{name}[/]: {extra}")


#: how each plugin status is coloured in the plugins table (any other status: red)
_STATUS_STYLE = {"selected": "bold green", "available": "green", "unavailable": "yellow", "loaded": "green",
                 "blocked": "yellow"}


def _plugins_table(plugins):
    """One row per discovered plugin: status, priority, device type, contract version, reason or source."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="plugins", show_lines=False)
    for col in ("name", "status", "prio", "device", "api", "reason / source"):
        t.add_column(col)
    for p in plugins:
        st = p["status"] + (" (emulated)" if p["emulated"] else "")
        t.add_row(p["name"], f"[{_STATUS_STYLE.get(p['status'], 'red')}]{st}[/]",
                  str(p["priority"] if p["priority"] is not None else "-"), str(p["device_type"] or "-"),
                  str(p["api_version"] or "-"), escape(p["reason"] or p["source"]))
    return t


def _print_selected(con, sel) -> None:
    """The selected accelerator: device type, communication backend, capabilities, comm hooks."""
    con.print(f"selected: [bold]{sel['name']}[/] (device type {sel['device_type']}, "
              f"comm {sel['communication_backend']}{', emulated' if sel['emulated'] else ''})")
    con.print("capabilities: " + (", ".join(sel["capabilities"]) or "none"))
    comm = sel.get("comm") or {}
    if "error" in comm:
        con.print(f"comm hooks: [red]{comm['error']}[/]")
    elif comm:
        emulated = "; ".join(f"{k} ({v})" for k, v in comm["emulated_collectives"].items()) or "none"
        tensors = "device tensors" if comm["supports_device_tensors"] else "staged through host buffers"
        con.print(f"comm: backend {comm['backend']}, {tensors}, emulated collectives: {emulated}")


def _ops_table(device_type: str, ops: dict):
    """One row per op: the builder chosen on ``device_type`` and why, and why not the others."""
    from rich.table import Table

    ot = Table(title=f"ops on {device_type}")
    for col in ("op", "builder", "plugin", "kind", "why"):
        ot.add_column(col)
    for op, info in sorted(ops.items()):
        if "error" in info:
            ot.add_row(op, "-", "-", "-", f"[red]{info['error']}[/]")
            continue
        chosen = next((c for c in info["candidates"] if c["chosen"]), None)
        others = "; ".join(f"{c['builder']}: {c['reason']}" for c in info["candidates"] if not c["chosen"])
        if chosen:
            ot.add_row(op, chosen["builder"], chosen["plugin"], chosen["kind"],
                       chosen["reason"] + (f" (others: {others})" if others else ""))
    return ot
