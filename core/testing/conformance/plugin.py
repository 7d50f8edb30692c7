"""The conformance suite's pytest plugin.

Load it with ``-p polyaccel.testing.conformance.plugin`` and collect the suite with
``--pyargs polyaccel.testing.conformance``::

    pytest -p polyaccel.testing.conformance.plugin --pyargs polyaccel.testing.conformance \\
        --polyaccel-accelerator NAME [--polyaccel-emulate] [--polyaccel-json FILE]

It selects the accelerator under test once (option > ``POLYACCEL_ACCELERATOR`` > the
normal auto-selection), optionally inside its emulated runtime, gives the tests the
``conformance_target`` and ``conformance_row`` fixtures, and turns every test report
into a row (PASS / FAIL / UNSUPPORTED / SKIPPED) of the JSON document.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import time

import pytest

from ...errors import PolyaccelError
from . import results
from .progress import ProgressWriter
from .results import (
    FAIL,
    PASS,
    PROP_AREA,
    PROP_CHECK,
    PROP_CLAIMED,
    PROP_DETAIL,
    PROP_STATUS,
    PROP_SUBJECT,
    PROP_VARIANT,
    SKIPPED,
    UNSUPPORTED,
    Document,
    Row,
)
from .target import Target, TargetError, enter_emulation, requested_name, select_target

MARKER = "conformance"
_HERE = pathlib.Path(__file__).resolve().parent
_STATE = pytest.StashKey["_SuiteState"]()


class _SuiteState:
    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.target: Target | None = None
        self.error: str | None = None
        self.rows: dict[str, Row] = {}
        self.json_path: str | None = None
        self.started = time.monotonic()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("polyaccel-conformance", "polyaccel conformance suite")
    group.addoption("--polyaccel-accelerator", default=None, metavar="NAME",
                    help="accelerator plugin to certify (default: $POLYACCEL_ACCELERATOR, else the auto-selected one)")
    group.addoption("--polyaccel-emulate", action="store_true", default=False,
                    help="run inside the emulated runtime a plugin offers for NAME (CPU stand-in runtime)")
    group.addoption("--polyaccel-json", default=None, metavar="FILE",
                    help="write the conformance document (docs/conformance-json.md) to FILE")
    group.addoption("--polyaccel-fuzz", action="store_true", default=False,
                    help="also run the op-contract fuzz rows (test_fuzz.py; needs hypothesis)")
    group.addoption("--polyaccel-fuzz-examples", type=int, default=None, metavar="N",
                    help="drawn cases per (op, builder) fuzz row (default: the CI budget)")
    group.addoption("--polyaccel-fuzz-seed", type=int, default=None, metavar="S",
                    help="draw the fuzz cases from seed S (default: a fixed, derandomized set)")
    group.addoption("--polyaccel-progress-fd", type=int, default=None, metavar="FD",
                    help="write each check's start and finish to this open file descriptor, as JSON lines "
                         "(the runner's progress pipe)")


FUZZ_MODULE = "test_fuzz.py"


def pytest_ignore_collect(collection_path, config):
    """The fuzz rows are collected only when asked for (--polyaccel-fuzz)."""
    if collection_path.name == FUZZ_MODULE and collection_path.resolve().parent == _HERE:
        return None if config.getoption("--polyaccel-fuzz") else True
    return None


def fuzz_budget(config) -> tuple[int, int | None]:
    """(examples per fuzz row, seed or None) as the options ask."""
    from .fuzz import DEFAULT_EXAMPLES

    examples = config.getoption("--polyaccel-fuzz-examples")
    return (DEFAULT_EXAMPLES if examples is None else examples), config.getoption("--polyaccel-fuzz-seed")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(area, subject, check, variant=''): where a conformance check belongs in the report")
    state = _SuiteState()
    config.stash[_STATE] = state
    state.json_path = config.getoption("--polyaccel-json")
    progress_fd = config.getoption("--polyaccel-progress-fd")
    if progress_fd is not None and not hasattr(config, "workerinput"):
        try:
            writer = ProgressWriter(progress_fd)
        except OSError as exc:
            state.error = (f"--polyaccel-progress-fd {progress_fd} is not a file descriptor open for writing "
                           f"({exc.strerror}); the runner passes its pipe's, leave it out elsewhere")
            _write(config, exitstatus=4)
            raise pytest.UsageError(f"polyaccel conformance: {state.error}") from None
        config.pluginmanager.register(writer, "polyaccel-conformance-progress")
    examples = config.getoption("--polyaccel-fuzz-examples")
    if examples is not None and examples < 1:
        state.error = f"--fuzz-examples must be at least 1, got {examples}"
        _write(config, exitstatus=4)
        raise pytest.UsageError(f"polyaccel conformance: {state.error}")
    name = requested_name(config.getoption("--polyaccel-accelerator"))
    try:
        if config.getoption("--polyaccel-emulate"):
            enter_emulation(state.stack, name)
        state.target = select_target(name)
    except TargetError as exc:
        state.error = str(exc)
        _write(config, exitstatus=4)
        state.stack.close()
        raise pytest.UsageError(f"polyaccel conformance: {exc}") from None
    except BaseException:
        state.stack.close()
        raise
    config.pluginmanager.register(_Collector(config, state), "polyaccel-conformance-collector")


def pytest_unconfigure(config) -> None:
    state = config.stash.get(_STATE, None)
    if state is not None:
        state.stack.close()


def pytest_report_header(config):
    state = config.stash.get(_STATE, None)
    if state is None or state.target is None:
        return None
    t = state.target
    emu = " [emulated]" if t.emulated else ""
    return (f"polyaccel conformance: accelerator {t.name!r}{emu} (device type {t.device_type!r}), "
            f"claims: {', '.join(sorted(t.capabilities)) or 'nothing'}")


def get_target(config) -> Target:
    state = config.stash[_STATE]
    if state.target is None:
        raise PolyaccelError("the polyaccel conformance plugin has no target accelerator")
    return state.target


@pytest.fixture(scope="session")
def conformance_target(request) -> Target:
    """The :class:`~polyaccel.testing.conformance.target.Target` under test."""
    return get_target(request.config)


class RowRecorder:
    """What a test tells the report beyond pass/fail: whether the capability is claimed,
    and that an unclaimed capability was verified to raise ``Unsupported``."""

    def __init__(self, item) -> None:
        self._item = item

    def claimed(self, value: bool) -> None:
        self._item.user_properties.append((PROP_CLAIMED, bool(value)))

    def unsupported_verified(self, detail: str) -> None:
        self._item.user_properties.append((PROP_STATUS, UNSUPPORTED))
        self._item.user_properties.append((PROP_DETAIL, detail))

    def note(self, detail: str) -> None:
        self._item.user_properties.append((PROP_DETAIL, detail))


@pytest.fixture
def conformance_row(request) -> RowRecorder:
    return RowRecorder(request.node)


def pytest_collection_modifyitems(session, config, items) -> None:
    for item in items:
        mark = item.get_closest_marker(MARKER)
        if mark is None:
            continue
        kw = dict(mark.kwargs)
        for key, prop in (("area", PROP_AREA), ("subject", PROP_SUBJECT), ("check", PROP_CHECK),
                          ("variant", PROP_VARIANT)):
            if kw.get(key) not in (None, ""):
                item.user_properties.append((prop, str(kw[key])))


def _props(report) -> dict:
    out = {}
    for key, value in report.user_properties:
        if key == PROP_DETAIL and key in out:
            out[key] = f"{out[key]}; {value}"
        else:
            out[key] = value
    return out


def _short_reason(report) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # skip: (path, lineno, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and crash.message:
        return crash.message.strip().removeprefix("Failed: ")
    text = str(longrepr).strip().splitlines()
    return text[-1] if text else ""


class _Collector:
    """Registered for one session: turns reports into rows and writes the document at the end."""

    def __init__(self, config, state: _SuiteState) -> None:
        self.config = config
        self.state = state

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session) -> None:
        self.state.started = time.monotonic()

    def pytest_runtest_logreport(self, report) -> None:
        state = self.state
        props = _props(report)
        if PROP_AREA not in props:
            return
        row = state.rows.get(report.nodeid)
        if row is None:
            row = Row(area=props[PROP_AREA], subject=props.get(PROP_SUBJECT, ""),
                      check=props.get(PROP_CHECK, ""), variant=props.get(PROP_VARIANT, ""),
                      test=report.nodeid.rsplit("/", 1)[-1],
                      emulated=bool(state.target and state.target.emulated))
            state.rows[report.nodeid] = row
        row.duration_s += getattr(report, "duration", 0.0) or 0.0
        if PROP_CLAIMED in props:
            row.claimed = bool(props[PROP_CLAIMED])
        if row.status == FAIL:
            return  # the first failure (e.g. the call) explains the row; a later teardown error does not
        if report.failed:
            phase = "" if report.when == "call" else f"error in {report.when}: "
            row.status = FAIL
            row.reason = phase + _short_reason(report)
        elif report.skipped:
            row.status = SKIPPED
            row.reason = _short_reason(report)
        elif report.when == "call":
            row.status = UNSUPPORTED if props.get(PROP_STATUS) == UNSUPPORTED else PASS
            row.reason = props.get(PROP_DETAIL, "")

    def pytest_collectreport(self, report) -> None:
        """A module that cannot be collected is a FAIL row, never a silently shorter table."""
        if not report.failed:
            return
        where = report.nodeid or "collection"
        self.state.rows[f"collect:{where}"] = Row(area="suite", subject="collection",
                                                  check=where.rsplit("/", 1)[-1], status=FAIL,
                                                  reason=_short_reason(report))

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        _write(self.config, int(exitstatus))


def _write(config, exitstatus: int) -> None:
    state = config.stash.get(_STATE, None)
    if state is None or not state.json_path or hasattr(config, "workerinput"):
        return  # under pytest-xdist only the controller, which sees every report, writes the document
    doc = Document(
        accelerator=state.target.describe() if state.target is not None else None,
        rows=list(state.rows.values()),
        error=state.error,
        exit_status=exitstatus,
        versions=results.versions(),
        duration_s=time.monotonic() - state.started,
    )
    if doc.error is None and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        doc.error = "no conformance check was selected (nothing collected, or -k deselected everything)"
    elif doc.error is None and exitstatus not in (0, 1):
        doc.error = f"pytest ended with exit status {exitstatus} (interrupted, internal or usage error)"
    doc.write(os.fspath(state.json_path))


__all__ = ["FAIL", "PASS", "SKIPPED", "UNSUPPORTED", "RowRecorder", "conformance_row", "conformance_target",
           "get_target"]
