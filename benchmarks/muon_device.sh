#!/usr/bin/env bash
# One device call for the Muon benchmark: install polyaccel, run bench_muon.py (with the tile sweep),
# writing OUTDIR/muon.json and OUTDIR/muon.log.
#   bash benchmarks/muon_device.sh OUTDIR
# Prints the Newton-Schulz rate as a share of the bf16 GEMM rate (target >= 0.70) and the Muon step
# time against torch.optim.Muon.
set -u
OUT=${1:?usage: muon_device.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || echo "polyaccel install failed"
cd benchmarks
timeout "${LIMIT:-420}" python3 bench_muon.py --sweep --out "$OUT/muon.json" 2>&1 | tee "$OUT/muon.log"
echo "== bench_muon: exit ${PIPESTATUS[0]}"
