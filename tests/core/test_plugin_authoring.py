"""What a vendor meets when writing a plugin from the docs, with the plugin installed as a real
distribution: a raising op hook isolates the plugin with its error everywhere the user looks;
op-only and name-only plugins are described accurately; a name claimed twice has a stated,
install-order-independent winner; a host-backed plugin needs no copied overrides."""

from __future__ import annotations

import json
import os

import polyaccel
import pytest
import torch
from polyaccel import ops, selection
from polyaccel.cli import main
from polyaccel.errors import OpError, SelectionError
from polyaccel.testing.conformance import run_suite
from polyaccel.testing.distributions import temporary_distribution

HEADER = '''
import torch
from polyaccel.accelerator import Accelerator, ProbeResult
from polyaccel.hookspecs import hookimpl
from polyaccel.ops import OpBuilder
from polyaccel.ops.reference import make_swiglu, swiglu_backward, swiglu_forward

POLYACCEL_API_VERSION = "1.0"
'''

#: an accelerator plugin whose op hook adds a builder, then raises
RAISING_OPS = HEADER + '''

class AcmeAccelerator(Accelerator):
    name = "acme"
    device_type = "cpu"
    priority = 50

    def probe(self):
        return ProbeResult(True, "acme board 0 answered", 1)


@hookimpl
def polyaccel_accelerators():
    return [AcmeAccelerator]


@hookimpl
def polyaccel_register_ops(registry):
    registry.add(OpBuilder(op="swiglu", name="acme_swiglu", device_types=("cpu",),
                           loader=lambda: make_swiglu(swiglu_forward, swiglu_backward), priority=90))
    raise RuntimeError("acme kernel table is corrupt")


@hookimpl
def polyaccel_report(accelerator):
    return {"acme": "this hook belongs to an isolated plugin and must not run"}
'''

#: an op-only plugin (no accelerator) that works, and one that raises before adding anything
OP_ONLY = HEADER + '''

@hookimpl
def polyaccel_accelerators():
    return []


@hookimpl
def polyaccel_register_ops(registry):
    registry.add(OpBuilder(op="quantize", name="vendor_quantize", device_types=("cuda",),
                           loader=lambda: None, kind="vendor", priority=70))
'''

OP_ONLY_RAISING = HEADER + '''

@hookimpl
def polyaccel_register_ops(registry):
    raise ImportError("libvendorops.so: cannot open shared object file")
'''


def accelerator_plugin(name: str, priority: int, probe_reason: str = "", extra: str = "") -> str:
    return HEADER + f'''

class Acc(Accelerator):
    name = "{name}"
    device_type = "cpu"
    priority = {priority}

    def probe(self):
        return ProbeResult(True, "{probe_reason}", 1)
{extra}

@hookimpl
def polyaccel_accelerators():
    return [Acc]
'''


@pytest.fixture
def install(tmp_path):
    """Install plugin distributions (entry point group polyaccel.plugins) for one test."""
    stack = []

    def _install(dist_name, entry_name, source, module=None):
        module = module or f"pa_auth_{dist_name.replace('-', '_')}"
        root = tmp_path / dist_name
        cm = temporary_distribution(root, dist_name, {"polyaccel.plugins": {entry_name: module}},
                                    {f"{module}.py": source})
        cm.__enter__()
        stack.append(cm)
        selection.reset()
        return root

    yield _install
    for cm in reversed(stack):
        cm.__exit__(None, None, None)
    selection.reset()


def report_json(capsys) -> dict:
    main(["report", "--json"])
    return json.loads(capsys.readouterr().out)


def plugin_entry(rep, name):
    return next(p for p in rep["plugins"] if p["name"] == name)


# ------------------------------------------------------------------ a raising op hook
def test_raising_op_hook_isolates_the_plugin_in_report_json_and_explain(install, capsys):
    install("acme-polyaccel", "acme", RAISING_OPS)
    rep = report_json(capsys)
    acme = plugin_entry(rep, "acme")
    assert acme["status"] == "failed"
    assert "polyaccel_register_ops raised RuntimeError: acme kernel table is corrupt" in acme["reason"]
    assert "isolated" in acme["reason"] and "accelerator is not used" in acme["reason"]
    assert rep["op_registration_errors"]["acme"]["dropped_builders"] == ["acme_swiglu (swiglu)"]
    assert "acme kernel table is corrupt" in rep["op_registration_errors"]["acme"]["reason"]
    # isolated: priority 50 would have won auto-selection; its other hooks no longer run
    assert rep["selected"]["name"] == "cpu"
    assert "acme" not in rep["extra"]
    # its partial builders are dropped
    builders = [c["builder"] for c in rep["ops"]["swiglu"]["candidates"]]
    assert "acme_swiglu" not in builders
    assert all(b.name != "acme_swiglu" for b in ops.registry.builders("swiglu"))
    assert ops.registry.chosen("swiglu", "cpu").name == "reference"

    text = ops.explain("swiglu", "cpu")
    assert "plugin 'acme'" in text and "acme kernel table is corrupt" in text
    assert "dropped: acme_swiglu (swiglu)" in text
    assert "acme kernel table is corrupt" in ops.explain("fused_adam", "cpu")  # every explain shows it


def test_raising_op_hook_is_logged_once_at_discovery(install, caplog):
    install("acme-polyaccel", "acme", RAISING_OPS)
    with caplog.at_level("WARNING", logger="polyaccel"):
        selection.plugins()
        selection.plugins()
    hits = [r.getMessage() for r in caplog.records if "acme kernel table is corrupt" in r.getMessage()]
    assert len(hits) == 1 and "plugin 'acme'" in hits[0] and "isolated" in hits[0]


def test_raising_op_hook_shows_in_the_human_report_and_blocks_selection_by_name(install, capsys, monkeypatch):
    install("acme-polyaccel", "acme", RAISING_OPS)
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["report"]) == 0
    raw = capsys.readouterr().out
    assert max(map(len, raw.splitlines())) <= 100
    out = " ".join(raw.split())  # the report wraps long reasons on word boundaries
    assert "acme kernel table is corrupt" in out and "failed" in out
    assert "op builders of acme ignored" in out and "acme_swiglu (swiglu)" in out
    selection.reset()
    monkeypatch.setenv("POLYACCEL_ACCELERATOR", "acme")
    with pytest.raises(SelectionError, match="'acme' is failed: polyaccel_register_ops raised RuntimeError"):
        polyaccel.get_accelerator()


def test_op_only_plugins_are_loaded_not_available_and_a_raising_one_fails(install, capsys):
    install("vendor-ops", "vendorops", OP_ONLY)
    install("broken-ops", "brokenops", OP_ONLY_RAISING)
    rep = report_json(capsys)
    good, bad = plugin_entry(rep, "vendorops"), plugin_entry(rep, "brokenops")
    assert good["status"] == "loaded" and "no accelerator" in good["reason"]
    assert "vendor_quantize (quantize)" in good["reason"]
    assert bad["status"] == "failed" and "ImportError: libvendorops.so" in bad["reason"]
    assert rep["op_registration_errors"]["brokenops"]["dropped_builders"] == []
    assert [b.name for b in ops.registry.builders("quantize") if b.plugin == "vendorops"] == ["vendor_quantize"]


def test_an_unavailable_plugin_whose_op_hook_raises_fails_and_keeps_its_probe_reason(install, capsys):
    source = accelerator_plugin("down", 50).replace('ProbeResult(True, "", 1)', 'ProbeResult(False, "no board found")')
    source += """

@hookimpl
def polyaccel_register_ops(registry):
    raise KeyError("kernel table")
"""
    install("down-polyaccel", "down", source)
    entry = plugin_entry(report_json(capsys), "down")
    assert entry["status"] == "failed"
    assert entry["reason"].startswith("polyaccel_register_ops raised KeyError: 'kernel table'")
    assert "(before that it was unavailable: no board found)" in entry["reason"]


def test_a_hook_that_raises_after_selection_keeps_the_selected_accelerator_and_says_so():
    """Discovery registers ops before selection; a re-population that fails later cannot unselect."""
    from polyaccel.hookspecs import hookimpl

    calls = []

    class Flaky:
        POLYACCEL_API_VERSION = "1.0"

        @hookimpl
        def polyaccel_accelerators(self):
            from polyaccel.plugins.cpu.accelerator import CpuAccelerator

            return [type("FlakyAcc", (CpuAccelerator,), {"name": "flaky", "priority": 99})]

        @hookimpl
        def polyaccel_register_ops(self, registry):
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("second registration failed")

    polyaccel.register_plugin("flaky", Flaky())
    assert polyaccel.get_accelerator().name == "flaky"
    ops.registry.reset()
    ops.registry.ops()
    rec = selection.plugins().records["flaky"]
    assert rec.status == "selected" and "second registration failed" in rec.reason
    assert "stays in use" in rec.reason


def test_a_builder_added_under_a_taken_name_fails_only_that_plugin(install, capsys):
    clash = HEADER + '''

@hookimpl
def polyaccel_register_ops(registry):
    registry.add(OpBuilder(op="fused_adam", name="cpu_fused_adam", device_types=("cpu",), loader=lambda: print))
'''
    install("clash-ops", "clash", clash)
    rep = report_json(capsys)
    entry = plugin_entry(rep, "clash")
    assert entry["status"] == "failed" and "already has a builder named 'cpu_fused_adam'" in entry["reason"]
    assert "from plugin 'cpu'" in entry["reason"]
    assert ops.registry.chosen("fused_adam", "cpu").plugin == "cpu"


def test_loader_must_return_a_callable():
    reg = ops.OpRegistry()
    reg.add(ops.OpBuilder("swiglu", "fallback", ("cpu",), lambda: torch.mul, priority=1))
    reg.add(ops.OpBuilder("swiglu", "returns_none", ("cpu",), lambda: None, priority=5))
    assert reg.resolve("swiglu", "cpu") is torch.mul
    text = reg.explain("swiglu", "cpu")
    assert "returns_none" in text and "its loader returned None, not the op's callable" in text
    reg.override("swiglu", "returns_none")
    with pytest.raises(OpError, match="not the op's callable"):
        reg.resolve("swiglu", "cpu")


# ------------------------------------------------------------- messages and statuses
def test_only_name_selectable_accelerators_give_an_accurate_error(install, monkeypatch, capsys):
    install("acme-polyaccel", "acme", accelerator_plugin("acme", -10, "acme board 0 answered"))
    monkeypatch.setenv("POLYACCEL_PLUGINS", "acme")
    selection.reset()
    with pytest.raises(SelectionError) as err:
        polyaccel.get_accelerator()
    msg = str(err.value)
    assert "no accelerator is available" not in msg
    assert "'acme' (priority -10) is selectable by name only" in msg
    assert "POLYACCEL_ACCELERATOR=acme" in msg and "polyaccel.set_accelerator('acme')" in msg
    assert "acme: available: acme board 0 answered (priority -10: selectable by name only" in msg
    assert "cpu: blocked: not in POLYACCEL_PLUGINS=acme" in msg
    rep = report_json(capsys)
    assert rep["selected"] is None and "selectable by name only" in rep["selection_error"]
    selection.reset()
    monkeypatch.setenv("POLYACCEL_ACCELERATOR", "acme")
    assert polyaccel.get_accelerator().name == "acme"


def test_two_name_only_accelerators_are_both_named(install, monkeypatch):
    install("acme-polyaccel", "acme", accelerator_plugin("acme", -10))
    install("zeta-polyaccel", "zeta", accelerator_plugin("zeta", -1))
    monkeypatch.setenv("POLYACCEL_PLUGINS", "acme,zeta")
    selection.reset()
    with pytest.raises(SelectionError) as err:
        polyaccel.get_accelerator()
    msg = str(err.value)
    assert "accelerators 'acme' (priority -10), 'zeta' (priority -1) are selectable by name only" in msg
    assert "POLYACCEL_ACCELERATOR=<name>" in msg and "(acme, zeta)" in msg


def test_no_accelerator_at_all_still_says_install_one(monkeypatch):
    monkeypatch.setenv("POLYACCEL_DISABLE_PLUGINS", "cpu,example")  # example: if it is installed
    selection.reset()
    with pytest.raises(SelectionError, match=r"no accelerator is available\. Install a backend plugin"):
        polyaccel.get_accelerator()


def test_an_available_plugins_probe_reason_is_shown(install, capsys):
    install("acme-polyaccel", "acme", accelerator_plugin("acme", -10, "acme board 0 answered, firmware 4.2"))
    rep = report_json(capsys)
    acme = plugin_entry(rep, "acme")
    assert acme["status"] == "available" and acme["reason"] == "acme board 0 answered, firmware 4.2"
    assert "acme: available: acme board 0 answered" in selection.plugins().summary()


def test_allowlist_marks_unlisted_plugins_blocked_even_when_their_name_is_claimed_twice(install, monkeypatch):
    # a third party (alphabetically before "polyaccel") also claims the in-tree name "cpu"
    install("aaa-cpu-clone", "cpu", accelerator_plugin("cpu", 5))
    install("acme-polyaccel", "acme", accelerator_plugin("acme", 50))
    monkeypatch.setenv("POLYACCEL_PLUGINS", "acme")
    selection.reset()
    assert polyaccel.get_accelerator().name == "acme"
    cpu = {k: r for k, r in selection.plugins().records.items() if k.split("#")[0] == "cpu"}
    assert len(cpu) == 2 and {r.status for r in cpu.values()} == {"blocked"}, {
        k: (r.status, r.reason) for k, r in cpu.items()}
    assert all(r.reason == "not in POLYACCEL_PLUGINS=acme" for r in cpu.values())


def test_a_registered_plugin_takes_a_name_whose_entry_point_is_blocked(monkeypatch):
    import polyaccel.plugins.cpu as cpu_plugin

    monkeypatch.setenv("POLYACCEL_PLUGINS", "nothing-else")
    selection.reset()
    polyaccel.register_plugin("cpu", cpu_plugin)  # explicit registration is not subject to the allowlist
    assert polyaccel.get_accelerator().name == "cpu"
    recs = selection.plugins().records
    assert recs["cpu"].source == "registered" and recs["cpu"].status == "selected"
    blocked = [r for k, r in recs.items() if k.startswith("cpu#")]
    assert [(r.status, r.source.startswith("entry point polyaccel.plugins.cpu")) for r in blocked] == [
        ("blocked", True)]


def test_in_tree_plugins_win_a_name_clash_and_the_loser_names_the_winner(install):
    install("aaa-cpu-clone", "cpu", accelerator_plugin("cpu", 5))
    assert polyaccel.get_accelerator().name == "cpu"
    recs = selection.plugins().records
    assert recs["cpu"].dist_name == "polyaccel" and recs["cpu"].status == "selected"
    loser = next(r for k, r in recs.items() if k.startswith("cpu#"))
    assert loser.status == "duplicate" and "aaa-cpu-clone" in loser.source
    assert "also provided by entry point polyaccel.plugins.cpu (polyaccel " in loser.reason
    assert "polyaccel's own plugins first" in loser.reason


@pytest.mark.parametrize("order", [("pa-zeta-twin", "pa-alpha-twin"), ("pa-alpha-twin", "pa-zeta-twin")])
def test_a_name_two_distributions_claim_goes_to_the_same_one_whatever_the_install_order(install, order):
    sources = {"pa-alpha-twin": accelerator_plugin("twin", 40, "the alpha build"),
               "pa-zeta-twin": accelerator_plugin("twin", 60, "the zeta build")}
    for dist in order:
        install(dist, "twin", sources[dist])
    acc = polyaccel.get_accelerator()
    assert acc.name == "twin" and acc.probe().reason == "the alpha build"
    recs = selection.plugins().records
    assert "(pa-alpha-twin 1.0)" in recs["twin"].source
    loser = next(r for k, r in recs.items() if k.startswith("twin#"))
    assert loser.status == "duplicate" and "(pa-zeta-twin 1.0)" in loser.source
    assert "also provided by entry point pa_auth_pa_alpha_twin (pa-alpha-twin 1.0), which wins" in loser.reason
    assert "alphabetical order of their distribution names" in loser.reason


# ------------------------------------------------------------------ host-backed plugins
HOST_ONLY = HEADER + '''

class HostOnly(Accelerator):
    """Identity and probe only: everything else comes from the base class."""

    name = "hostonly"
    device_type = "cpu"
    priority = -5

    def probe(self):
        return ProbeResult(True, "the host", 1)


class HostClaims(HostOnly):
    """The same, claiming what the host's defaults back (rng, dtypes)."""

    name = "hostclaims"

    def capabilities(self):
        return frozenset({"rng", "fp64", "bf16"})


@hookimpl
def polyaccel_accelerators():
    return [HostOnly, HostClaims]
'''


@pytest.mark.parametrize("name", ["hostonly", "hostclaims"])
def test_a_host_backed_plugin_with_identity_and_probe_only_conforms(install, monkeypatch, name):
    root = install("polyaccel-hostonly", "hostonly", HOST_ONLY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    run = run_suite(name, keyword="not comm", timeout=300)
    assert run.error() is None, run.output[-3000:]
    assert run.ok, [(r["id"], r["reason"]) for r in run.rows() if r["status"] == "FAIL"]
    rows = {r["id"]: r for r in run.rows()}
    assert rows["device/devices/count_current_set"]["status"] == "PASS"
    rng = rows["capability/rng/seed_reproducible_state_roundtrip"]["status"]
    assert rng == ("PASS" if name == "hostclaims" else "UNSUPPORTED")


def test_host_defaults_of_the_base_class():
    from polyaccel.accelerator import ProbeResult
    from polyaccel.errors import Unsupported
    from polyaccel.host_accelerator import HostAccelerator

    class Host(HostAccelerator):
        name = "host"
        device_type = "cpu"

        def probe(self):
            return ProbeResult(True, "", 1)

    class HostRng(Host):
        def capabilities(self):
            return frozenset({"rng"})

    acc = Host()
    assert acc.device() == torch.device("cpu") and acc.device(0) == torch.device("cpu")
    assert (acc.device_count(), acc.current_device()) == (1, 0)
    acc.set_device(0)
    acc.synchronize()
    with pytest.raises(ValueError, match="one host device per process"):
        acc.set_device(3)
    assert acc.is_synchronized_device() and acc.use_host_timers() and acc.resolves_data_dependency()
    acc.empty_cache()
    with pytest.raises(Unsupported):
        acc.manual_seed(1)  # not claimed: says so rather than seeding silently
    rng = HostRng()
    rng.manual_seed(11)
    state = rng.get_rng_state()
    a = torch.randn(4)
    rng.set_rng_state(state)
    assert torch.equal(a, torch.randn(4)) and rng.initial_seed() == 11


def test_device_index_parsing():
    from polyaccel.device_generic import device_index as _device_index

    assert _device_index(3) == 3
    assert _device_index("cuda:1") == 1 and _device_index("cpu") == 0
    assert _device_index(torch.device("cuda", 2)) == 2
    with pytest.raises(TypeError):
        _device_index(True)


# ------------------------------------------------------------------ docs
def _docs(name: str) -> str:
    here = os.path.dirname(__file__)
    with open(os.path.join(here, "..", "..", "docs", name), encoding="utf-8") as fh:
        return fh.read()


def test_authoring_guide_carries_the_generated_op_reference():
    from polyaccel.ops.reference import op_reference_markdown

    doc = _docs("plugin-authoring.md")
    begin = "<!-- op reference: begin (generated by `python -m polyaccel.ops.reference`) -->\n"
    section = doc[doc.index(begin) + len(begin):doc.index("<!-- op reference: end -->")]
    assert section.strip() == op_reference_markdown().strip(), (
        "docs/plugin-authoring.md is out of date: paste the output of `python -m polyaccel.ops.reference` "
        "between the op reference markers")


def test_every_op_is_documented_with_the_signature_polyaccel_calls():
    import inspect

    from polyaccel.ops import builtin, reference

    text = reference.op_reference_markdown()
    for op, attr in builtin.REFERENCE_OPS.items():
        fn = getattr(reference, attr)
        doc = inspect.getdoc(fn) or ""
        assert len(doc) > 200, f"reference {op} has no real docstring"
        assert f"#### `{op}`" in text and f"\n{op}(" in text
        # the front end polyaccel.ops.<op> takes exactly the reference's parameters
        front = inspect.signature(getattr(ops, op)).parameters
        ref = inspect.signature(fn).parameters
        assert [(p.name, p.kind, p.default) for p in front.values()] == [
            (p.name, p.kind, p.default) for p in ref.values()], op
    assert "keyword-only" in text and "in place" in text


def test_authoring_guide_snippets_say_where_names_come_from():
    doc = _docs("plugin-authoring.md")
    assert "from polyaccel.ops.reference import make_swiglu" in doc
    assert "**The loader** takes no argument" in doc
    assert "POLYACCEL_ACCELERATOR=example" in doc
    assert "alphabetical order of their distribution names" in doc
    assert "| `loaded` |" in doc


def test_readme_installs_pytest_before_the_conformance_command():
    here = os.path.dirname(__file__)
    with open(os.path.join(here, "..", "..", "README.md"), encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    for i, line in enumerate(lines):
        if "polyaccel conformance" in line and not line.lstrip().startswith(("#", "|")):
            before = "\n".join(lines[max(0, i - 6):i + 1])
            assert '".[test]"' in before or "pytest" in before, before


def test_conformance_without_pytest_says_how_to_get_it(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else real(name, *a))
    assert main(["conformance", "--accelerator", "cpu"]) == 2
    assert "pip install polyaccel[conformance]" in capsys.readouterr().err
