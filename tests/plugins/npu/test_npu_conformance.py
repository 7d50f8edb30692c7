"""`polyaccel conformance --accelerator npu --emulate`: every row emulated, nothing failed."""

from __future__ import annotations

import json
import subprocess
import sys

CLI = "import sys; from polyaccel.cli import main; sys.exit(main(sys.argv[1:]))"


def test_conformance_under_emulation_passes_and_labels_every_row(tmp_path):
    out = tmp_path / "conformance.json"
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "conformance", "--accelerator", "npu", "--emulate", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    doc = json.loads(out.read_text()) if out.exists() else None
    failed = [(r["subject"], r["check"], r.get("variant"), r.get("reason")) for r in (doc or {}).get("rows", [])
              if r["status"] == "FAIL"]
    assert proc.returncode == 0, failed or (proc.stdout[-4000:] + proc.stderr[-4000:])
    assert doc is not None, "the suite wrote no JSON document"
    assert doc["accelerator"]["name"] == "npu" and doc["accelerator"]["emulated"] is True
    rows = doc["rows"]
    assert rows and all(r["emulated"] for r in rows), "every row produced under emulation must say so"
    failed = [(r["subject"], r["check"], r.get("reason")) for r in rows if r["status"] == "FAIL"]
    assert not failed and doc["counts"]["FAIL"] == 0, failed
    passed = {(r["area"], r["subject"]) for r in rows if r["status"] == "PASS"}
    for needed in (("capability", "graphs"), ("capability", "host_register"), ("capability", "memory_stats"),
                   ("capability", "pinned"), ("op", "fused_adam"),
                   ("op", "fused_lion"), ("op", "fused_lamb"), ("op", "quantize"), ("op", "rms_norm"), ("op", "rope")):
        assert needed in passed, f"{needed} did not pass: {sorted(passed)}"
