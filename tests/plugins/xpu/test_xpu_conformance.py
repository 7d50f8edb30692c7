"""`polyaccel conformance --accelerator xpu --emulate`: every row emulated, nothing FAILs, claims match rows."""

from __future__ import annotations

from polyaccel.cli import main
from polyaccel.testing.conformance import results


def test_xpu_conforms_under_emulation(tmp_path, capsys):
    out = tmp_path / "xpu.json"
    rc = main(["conformance", "--accelerator", "xpu", "--emulate", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    doc = results.load(str(out))
    assert doc["ok"] is True and doc["accelerator"]["name"] == "xpu" and doc["accelerator"]["emulated"] is True
    rows = doc["rows"]
    assert rows and all(r["emulated"] is True for r in rows)
    assert not [r for r in rows if r["status"] == "FAIL"]
    claims = set(doc["accelerator"]["capabilities"])
    assert {"graphs", "streams", "events", "pinned", "memory_stats", "rng"} <= claims
    for cap in ("graphs", "streams", "events", "pinned", "memory_stats", "rng"):
        assert {r["status"] for r in rows if r["subject"] == cap} == {"PASS"}, cap
    assert {r["status"] for r in rows if r["subject"] == "host_register"} == {"UNSUPPORTED"}
    adam = [r for r in rows if r["subject"] == "fused_adam" and "xpu_torch_fused_adam" in (r["variant"] or "")]
    assert adam and {r["status"] for r in adam} == {"PASS"}
