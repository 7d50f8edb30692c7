#!/usr/bin/env bash
# One device call for the Muon benchmarks: install polyaccel, then
#   bench_muon.py: the Newton-Schulz rate as a share of the bf16 GEMM rate (target >= 0.70) and the Muon
#                  step against torch.optim.Muon (SWEEP=1 adds the tile sweep)  -> OUTDIR/muon.{json,log}
#   zero_gpu.py --muon: a ZeRO-1 step (and ZeRO-1 + offload) of the 220M model with Muon beside the same
#                  row with AdamW (target <= 1.25x at stage 1)                    -> OUTDIR/zero_muon.{json,log}
#   bash benchmarks/muon_device.sh OUTDIR        (LIMIT: seconds per part, default 200)
set -u
OUT=${1:?usage: muon_device.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || echo "polyaccel install failed"
cd benchmarks
timeout "${LIMIT:-200}" python3 bench_muon.py ${SWEEP:+--sweep} --out "$OUT/muon.json" 2>&1 | tee "$OUT/muon.log"
echo "== bench_muon: exit ${PIPESTATUS[0]}"
timeout "${LIMIT:-200}" python3 zero_gpu.py --muon --only "stage 1" --peers '' --steps 6 --out "$OUT/zero_muon.json" \
  2>&1 | tee "$OUT/zero_muon.log"
echo "== zero_gpu --muon: exit ${PIPESTATUS[0]}"
