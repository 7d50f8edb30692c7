"""`polyaccel conformance --accelerator cpu` passes, and its table is exactly the cpu plugin's claims."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from polyaccel.accelerator import KNOWN_CAPABILITIES
from polyaccel.cli import main
from polyaccel.plugins.cpu.accelerator import CpuAccelerator
from polyaccel.testing.conformance import results

CPU_BUILDERS = {"fused_adam": "cpu_fused_adam", "fused_lion": "cpu_fused_lion", "fused_lamb": "cpu_fused_lamb"}


def test_cpu_conforms_and_rows_match_its_claims(tmp_path, capsys):
    out, junit = tmp_path / "cpu.json", tmp_path / "cpu.xml"
    rc = main(["conformance", "--accelerator", "cpu", "--json", str(out), "--junitxml", str(junit)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "CONFORMS" in printed and "UNSUPPORTED-verified" in printed
    doc = results.load(str(out))
    assert doc["ok"] is True and doc["error"] is None and doc["exit_status"] == 0
    assert doc["accelerator"]["name"] == "cpu" and doc["accelerator"]["emulated"] is False
    claims = CpuAccelerator().capabilities()
    assert set(doc["accelerator"]["capabilities"]) == claims
    rows = doc["rows"]
    assert not [r for r in rows if r["status"] == "FAIL"]
    assert all(r["emulated"] is False for r in rows)

    # every known capability has rows; claimed ones PASS, unclaimed ones are verified UNSUPPORTED
    for cap in KNOWN_CAPABILITIES:
        cap_rows = [r for r in rows if r["subject"] == cap]
        assert cap_rows, f"no row for capability {cap!r}"
        if cap == "async_p2p":  # declarative: p2p must work either way, blocking is allowed unclaimed
            assert [(r["status"], r["claimed"]) for r in cap_rows] == [("PASS", cap in claims)]
            continue
        want = "PASS" if cap in claims else "UNSUPPORTED"
        assert {(r["status"], r["claimed"]) for r in cap_rows} == {(want, cap in claims)}, cap_rows

    assert {r["status"] for r in rows if r["area"] == "device"} == {"PASS"}
    assert {r["status"] for r in rows if r["area"] == "comm"} == {"PASS"}
    # the cpu plugin's own builders are checked in each claimed optimizer dtype
    for op, builder in CPU_BUILDERS.items():
        dts = {r["variant"].split()[-1] for r in rows if r["subject"] == op and r["status"] == "PASS"
               and r["variant"].startswith(builder)}
        assert dts == {"float32", "bfloat16", "float16", "float64"}, (op, dts)
    # ops the cpu plugin has no builder for are served by the reference: shown, not claimed as verified
    for op in ("quantize", "dequantize", "swiglu", "grouped_mm", "gather_sum"):
        assert [r["status"] for r in rows if r["subject"] == op] == ["SKIPPED"], op

    cases = ET.parse(junit).getroot().iter("testcase")
    assert len(list(cases)) >= len(rows)
