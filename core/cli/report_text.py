"""The human layout of ``polyaccel report``: one line per plugin and per op, within the terminal's width (at
most 100 columns). Text wraps on word boundaries only; a word longer than its column (a URL in an install fix)
starts a line of its own instead of being cut. Works on the JSON-ready report of
:func:`polyaccel.report.build_report`."""

from __future__ import annotations

import shutil
import textwrap
from dataclasses import dataclass, field

MAX_WIDTH = 100
#: how far continuation lines of a long text go in when its column is too narrow for one of its words
HANGING_INDENT = 4

#: how each plugin status is coloured (any other status: red)
STATUS_STYLE = {"selected": "bold green", "available": "green", "unavailable": "yellow", "loaded": "green",
                "blocked": "yellow"}


@dataclass
class Line:
    """One output line and the styles of its spans ((start, end, rich style))."""

    text: str
    styles: list[tuple[int, int, str]] = field(default_factory=list)


def width() -> int:
    """The terminal's width (``COLUMNS`` when set), at most :data:`MAX_WIDTH`."""
    return min(shutil.get_terminal_size((MAX_WIDTH, 24)).columns, MAX_WIDTH)


def wrap(prefix: str, text: str, cols: int) -> list[str]:
    """``prefix`` + ``text`` over lines of at most ``cols`` characters, continuation lines aligned under the
    text; words are never cut: if one does not fit there, the text continues under a short hanging indent.
    The text's own line breaks are kept (a list in an error message stays a list, indented under the text)."""
    first, *rest = text.split("\n")
    out = _wrap_line(prefix, first, cols)
    for line in rest:
        body = line.lstrip()
        bullet = 2 if body.startswith(("- ", "* ")) else 0  # a list item's continuation goes under its text
        out += _wrap_line(" " * (HANGING_INDENT + len(line) - len(body)), body, cols, bullet) if body else []
    return out


def _wrap_line(prefix: str, text: str, cols: int, bullet: int = 0) -> list[str]:
    indent = " " * (len(prefix) + bullet)
    lines = textwrap.wrap(text, width=cols, initial_indent=prefix, subsequent_indent=indent,
                          break_long_words=False, break_on_hyphens=False) or [prefix.rstrip()]
    if all(len(line) <= cols for line in lines):
        return lines
    return [prefix.rstrip()] + textwrap.wrap(text, width=cols, initial_indent=" " * HANGING_INDENT,
                                             subsequent_indent=" " * HANGING_INDENT, break_long_words=False,
                                             break_on_hyphens=False)


def _columns(rows: list[list[str]]) -> list[str]:
    """Each row's cells left-aligned in columns two spaces apart (the last cell is not padded)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)] if rows else []
    return ["".join(c.ljust(w + 2) for c, w in zip(r, widths, strict=False)) for r in rows]


def header(rep: dict, cols: int) -> list[Line]:
    v = rep["versions"]
    return [Line(t) for t in wrap("polyaccel report  ", "  ".join(f"{k} {v[k] or '-'}" for k in v), cols)]


def plugins(rep: dict, cols: int) -> list[Line]:
    """One line per plugin (name, status, priority, device type, contract version), then its reason or
    source."""
    rows = [["name", "status", "prio", "device", "api", ""]]
    for p in rep["plugins"]:
        rows.append([p["name"], p["status"] + (" (emulated)" if p["emulated"] else ""),
                     str(p["priority"] if p["priority"] is not None else "-"), str(p["device_type"] or "-"),
                     str(p["api_version"] or "-"), p["reason"] or p["source"]])
    prefixes = _columns([r[:5] + [""] for r in rows])
    titles = "  " + prefixes[0] + "reason / source"
    out = [Line("plugins"), Line(titles, [(0, len(titles), "dim")])]
    status_at = max(len(r[0]) for r in rows) + 2  # where the status column starts, after the names
    for p, row, prefix in zip(rep["plugins"], rows[1:], prefixes[1:], strict=True):
        lines = wrap("  " + prefix, row[5], cols)
        start = 2 + status_at
        out.append(Line(lines[0], [(start, start + len(row[1]), STATUS_STYLE.get(p["status"], "red"))]))
        out += [Line(t) for t in lines[1:]]
    for name, info in (rep.get("op_registration_errors") or {}).items():
        dropped = ", ".join(info["dropped_builders"]) or "none"
        text = f"{info['reason']} (dropped: {dropped})"
        out += _styled(wrap(f"op builders of {name} ignored: ", text, cols), "red")
    return out


def selected(rep: dict, cols: int) -> list[Line]:
    """The selected accelerator: device type, communication backend, capabilities, comm hooks."""
    sel = rep["selected"]
    if sel is None:
        return _styled(wrap("no accelerator selected: ", str(rep["selection_error"]), cols), "bold red")
    text = (f"{sel['name']} (device type {sel['device_type']}, comm {sel['communication_backend']}"
            f"{', emulated' if sel['emulated'] else ''})")
    out = [Line(t) for t in wrap("selected: ", text, cols)]
    out += [Line(t) for t in wrap("capabilities: ", ", ".join(sel["capabilities"]) or "none", cols)]
    comm = sel.get("comm") or {}
    if "error" in comm:
        out += _styled(wrap("comm hooks: ", comm["error"], cols), "red")
    elif comm:
        emulated = "; ".join(f"{k} ({v})" for k, v in comm["emulated_collectives"].items()) or "none"
        tensors = "device tensors" if comm["supports_device_tensors"] else "staged through host buffers"
        text = f"backend {comm['backend']}, {tensors}, emulated collectives: {emulated}"
        out += [Line(t) for t in wrap("comm: ", text, cols)]
    return out


def _serves(candidate: dict, device_type: str) -> bool:
    return "*" in candidate["device_types"] or device_type in candidate["device_types"]


def _others(info: dict, device_type: str) -> str:
    """How many builders were not chosen: those for this device type, and those for other devices."""
    others = [c for c in info["candidates"] if not c["chosen"]]
    here = sum(_serves(c, device_type) for c in others)
    parts = [f"+{here} {device_type}"] if here else []
    if len(others) > here:
        parts.append(f"+{len(others) - here} elsewhere")
    return ", ".join(parts) or "none"


def ops(rep: dict, cols: int, verbose: bool) -> list[Line]:
    """One line per op: the builder chosen for the selected device type, its plugin and kind, and how many
    other builders there are; ``verbose`` adds why it was chosen and why each other one was not."""
    device_type = rep["selected"]["device_type"]
    rows, notes = [["op", "builder", "plugin", "kind", "other builders"]], [[]]
    for op, info in sorted(rep["ops"].items()):
        chosen = None if "error" in info else next((c for c in info["candidates"] if c["chosen"]), None)
        if chosen is None:
            rows.append([op, "-", "-", "-", info.get("error") or "no builder serves it"])
            notes.append([])
            continue
        rows.append([op, chosen["builder"], chosen["plugin"], chosen["kind"], _others(info, device_type)])
        notes.append(_why(info, chosen, device_type) if verbose else [])
    hint = "" if verbose else " (--verbose: why each builder was chosen or not)"
    out = [Line(f"ops on {device_type}{hint}")]
    for i, (row, prefix, why) in enumerate(zip(rows, _columns(rows), notes, strict=True)):
        lines = wrap("  " + prefix, row[4], cols)
        if i == 0 or row[1] == "-":  # the column titles; an op no builder serves
            out += _styled(lines, "dim" if i == 0 else "red")
        else:
            out += [Line(t) for t in lines]
        for label, text in why:
            out += [Line(t) for t in wrap(f"      {label}: ", text, cols)]
    return out


def _why(info: dict, chosen: dict, device_type: str) -> list[tuple[str, str]]:
    """(label, text) lines: why the chosen builder, why not each other one serving the device type, and the
    builders for other devices in one line."""
    why = [("chosen", chosen["reason"])]
    elsewhere = []
    for c in info["candidates"]:
        if c["chosen"]:
            continue
        if _serves(c, device_type):
            why.append((f"{c['builder']} ({c['plugin']})", c["reason"]))
        else:
            elsewhere.append(f"{c['builder']} ({', '.join(c['device_types'])})")
    if elsewhere:
        why.append(("for other devices", ", ".join(elsewhere)))
    return why


def _fact(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fact(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return "; ".join(_fact(v) for v in value) or "none"
    return str(value)


def extras(rep: dict, cols: int) -> list[Line]:
    """What plugins add about themselves, one wrapped line per plugin and fact."""
    out = []
    for name, facts in rep["extra"].items():
        for key, value in facts.items():
            out += [Line(t) for t in wrap(f"{name} {key}: ", _fact(value), cols)]
    return out


def extensions(rep: dict, cols: int) -> list[Line]:
    """The engines and model layers, each loaded or isolated with the reason."""
    out = []
    for title, key in (("engines", "engines"), ("model layers", "layers")):
        rows = rep.get(key) or []
        shown = ", ".join(r["name"] + ("" if r["status"] == "loaded" else f" {r['status']}") for r in rows)
        out += [Line(t) for t in wrap(f"{title}: ", shown or "none", cols)]
        for r in rows:
            if r["status"] != "loaded":
                why = f"{r['reason']} ({r['source']})"
                out += _styled(wrap(f"  {r['name']} {r['status']}: ", why, cols), "red")
    return out


def _styled(lines: list[str], style: str) -> list[Line]:
    return [Line(t, [(0, len(t), style)]) for t in lines]


def report_lines(rep: dict, cols: int | None = None, verbose: bool = False) -> list[Line]:
    """The whole human report."""
    cols = cols or width()
    out = header(rep, cols) + plugins(rep, cols) + selected(rep, cols)
    if rep["selected"] is not None:
        out += ops(rep, cols, verbose) + extras(rep, cols)
    return out + extensions(rep, cols)
