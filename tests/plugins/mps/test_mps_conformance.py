"""`polyaccel conformance --accelerator mps --emulate`: every row emulated, nothing FAILs, claims match rows."""

from __future__ import annotations

from polyaccel.cli import main
from polyaccel.testing.conformance import results


def test_mps_conforms_under_emulation(tmp_path, capsys):
    out = tmp_path / "mps.json"
    rc = main(["conformance", "--accelerator", "mps", "--emulate", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    doc = results.load(str(out))
    assert doc["ok"] is True and doc["accelerator"]["name"] == "mps" and doc["accelerator"]["emulated"] is True
    rows = doc["rows"]
    assert rows and all(r["emulated"] is True for r in rows)
    assert not [r for r in rows if r["status"] == "FAIL"]
    for cap in ("graphs", "streams", "host_register", "fp64"):
        assert {r["status"] for r in rows if r["subject"] == cap} == {"UNSUPPORTED"}, cap
    for cap in ("events", "pinned", "rng", "bf16", "fp16"):
        assert {r["status"] for r in rows if r["subject"] == cap} == {"PASS"}, cap
    metal = [r for r in rows if r["subject"] == "fused_adam" and "mps_metal_fused_adam" in (r["variant"] or "")]
    assert len(metal) == 3 and {r["status"] for r in metal} == {"PASS"}
