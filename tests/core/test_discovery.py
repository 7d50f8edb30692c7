"""Entry-point discovery, isolation of broken plugins, selection and the env switches."""

import json

import polyaccel
import pytest
from polyaccel import selection
from polyaccel.cli import main as cli_main
from polyaccel.errors import SelectionError
from polyaccel.testing.distributions import temporary_distribution

PLUGIN_TEMPLATE = '''
from polyaccel.hookspecs import hookimpl
from polyaccel.accelerator import Accelerator, ProbeResult

POLYACCEL_API_VERSION = "{api}"


class Acc(Accelerator):
    name = "{name}"
    device_type = "cpu"
    priority = {priority}

    def probe(self):
        {probe}

    def device_count(self):
        return 1

    def current_device(self):
        return 0


@hookimpl
def polyaccel_accelerators():
    {accelerators}
'''


def plugin_source(name, api="1.0", priority=50, probe="return ProbeResult(True, '', 1)",
                  accelerators="return [Acc]", header=""):
    return header + PLUGIN_TEMPLATE.format(name=name, api=api, priority=priority, probe=probe,
                                           accelerators=accelerators)


@pytest.fixture
def install(tmp_path):
    """Install fake plugin distributions for the duration of a test."""
    stack = []

    def _install(dist_name, entry_name, source, module=None):
        module = module or f"pa_test_{dist_name.replace('-', '_')}"
        cm = temporary_distribution(tmp_path / dist_name, dist_name,
                                    {"polyaccel.plugins": {entry_name: module}}, {f"{module}.py": source})
        cm.__enter__()
        stack.append(cm)
        selection.reset()

    yield _install
    for cm in reversed(stack):
        cm.__exit__(None, None, None)
    selection.reset()


def report_json(capsys):
    cli_main(["report", "--json"])
    return json.loads(capsys.readouterr().out)


def statuses(rep):
    return {p["name"]: (p["status"], p["reason"]) for p in rep["plugins"]}


def test_cpu_plugin_found_through_entry_point_and_selected_by_default():
    acc = polyaccel.get_accelerator()
    assert acc.name == "cpu"
    rec = selection.plugins().records["cpu"]
    assert rec.source.startswith("entry point polyaccel.plugins.cpu")
    assert rec.status == "selected"


def test_fake_plugin_selected_by_priority_and_by_env(install, monkeypatch):
    install("pa-fake", "fake", plugin_source("fake", priority=50))
    assert polyaccel.get_accelerator().name == "fake"
    selection.reset()
    monkeypatch.setenv("POLYACCEL_ACCELERATOR", "cpu")
    assert polyaccel.get_accelerator().name == "cpu"
    assert selection.plugins().records["fake"].status == "available"


def test_set_accelerator_overrides_env(install, monkeypatch):
    install("pa-fake", "fake", plugin_source("fake", priority=50))
    monkeypatch.setenv("POLYACCEL_ACCELERATOR", "fake")
    assert polyaccel.set_accelerator("cpu").name == "cpu"
    assert polyaccel.get_accelerator().name == "cpu"
    with pytest.raises(TypeError, match="plugin name or an Accelerator"):
        polyaccel.set_accelerator(3)


def test_unknown_accelerator_name_lists_every_plugin(install, monkeypatch):
    install("pa-down", "down", plugin_source("down", probe="return ProbeResult(False, 'no board present')"))
    monkeypatch.setenv("POLYACCEL_ACCELERATOR", "nosuch")
    with pytest.raises(SelectionError) as exc:
        polyaccel.get_accelerator()
    msg = str(exc.value)
    assert "'nosuch'" in msg and "cpu: available" in msg and "down: unavailable: no board present" in msg


def test_unavailable_accelerator_by_name_says_why(install, monkeypatch):
    install("pa-down", "down", plugin_source("down", probe="return ProbeResult(False, 'no board present')"))
    monkeypatch.setenv("POLYACCEL_ACCELERATOR", "down")
    with pytest.raises(SelectionError, match="'down' is unavailable: no board present"):
        polyaccel.get_accelerator()


def test_priority_tie_is_an_error_that_says_how_to_choose(install):
    install("pa-a", "alpha", plugin_source("alpha", priority=70))
    install("pa-b", "beta", plugin_source("beta", priority=70))
    with pytest.raises(SelectionError) as exc:
        polyaccel.get_accelerator()
    assert "alpha, beta" in str(exc.value) and "POLYACCEL_ACCELERATOR" in str(exc.value)


def test_broken_plugins_are_isolated_with_reasons(install, capsys):
    install("pa-imp", "importfail", "raise ImportError('libvendor.so: cannot open shared object file')\n")
    install("pa-hook", "hookfail", plugin_source("hookfail", accelerators="raise RuntimeError('boom')"))
    install("pa-old", "oldapi", plugin_source("oldapi", api="2.3"))
    install("pa-probe", "probefail", plugin_source("probefail", probe="raise OSError('driver crashed')"))
    install("pa-noversion", "noversion", "from polyaccel.hookspecs import hookimpl\n")
    install("pa-exit", "exits", "import sys\nsys.exit(127)\n")
    install("pa-good", "good", plugin_source("good", priority=30))
    install("pa-dup", "good", plugin_source("good", priority=30), module="pa_test_dup")
    rep = report_json(capsys)
    st = statuses(rep)
    assert st["importfail"][0] == "failed" and "libvendor.so" in st["importfail"][1]
    assert st["hookfail"][0] == "failed" and "boom" in st["hookfail"][1]
    assert st["oldapi"][0] == "incompatible" and "2.3" in st["oldapi"][1]
    assert st["probefail"][0] == "failed" and "driver crashed" in st["probefail"][1]
    assert st["noversion"][0] == "incompatible" and "POLYACCEL_API_VERSION" in st["noversion"][1]
    assert st["exits"][0] == "failed" and "SystemExit" in st["exits"][1]
    # the name "good" is claimed by distributions pa-good and pa-dup: the alphabetically first wins
    dups = [v for k, v in st.items() if k.startswith("good#")]
    assert dups and dups[0][0] == "duplicate" and "(pa-dup 1.0), which wins" in dups[0][1]
    # and the good one still works, selected by priority
    assert st["good"][0] == "selected"
    assert rep["selected"]["name"] == "good"


def test_allowlist_and_blocklist(install, monkeypatch):
    install("pa-fake", "fake", plugin_source("fake", priority=50))
    monkeypatch.setenv("POLYACCEL_DISABLE_PLUGINS", "fake")
    selection.reset()
    assert polyaccel.get_accelerator().name == "cpu"
    rec = selection.plugins().records["fake"]
    assert rec.status == "blocked" and "POLYACCEL_DISABLE_PLUGINS" in rec.reason
    assert rec.plugin is None  # blocked before loading

    monkeypatch.delenv("POLYACCEL_DISABLE_PLUGINS")
    monkeypatch.setenv("POLYACCEL_PLUGINS", "fake")
    selection.reset()
    assert polyaccel.get_accelerator().name == "fake"
    assert selection.plugins().records["cpu"].status == "blocked"


def test_disable_autoload_uses_only_registered_plugins(monkeypatch):
    import polyaccel.plugins.cpu as cpu_plugin

    monkeypatch.setenv("POLYACCEL_DISABLE_PLUGIN_AUTOLOAD", "1")
    selection.reset()
    with pytest.raises(SelectionError, match="no accelerator is available"):
        polyaccel.get_accelerator()
    selection.reset()
    polyaccel.register_plugin("mycpu", cpu_plugin)
    assert polyaccel.get_accelerator().name == "cpu"
    assert selection.plugins().records["mycpu"].source == "registered"


def test_report_cli_human_and_help(capsys):
    assert cli_main(["report"]) == 0
    out = capsys.readouterr().out
    assert "cpu" in out and "selected" in out and "fused_adam" in out
    with pytest.raises(SystemExit):
        cli_main(["report", "--help"])
    assert "POLYACCEL_ACCELERATOR" in capsys.readouterr().out


def test_report_json_lists_capabilities_and_op_choices(capsys):
    rep = report_json(capsys)
    assert rep["selected"]["name"] == "cpu"
    assert rep["selected"]["capabilities"] == sorted(polyaccel.get_accelerator().capabilities())
    chosen = {op: next(c["builder"] for c in info["candidates"] if c["chosen"]) for op, info in rep["ops"].items()}
    assert chosen["fused_adam"] == "cpu_fused_adam"
    assert chosen["quantize"] == "reference"
    assert rep["versions"]["torch"]
