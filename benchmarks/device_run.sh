#!/usr/bin/env bash
# One device call: install polyaccel, verify the cuda plugin, run conformance, run the benchmarks.
#   bash benchmarks/device_run.sh OUTDIR [run_all.py arguments]
# Writes report.txt, verify.log/.json, conformance.log, bench.log/.json under OUTDIR.
set -u
OUT=${1:?usage: device_run.sh OUTDIR [run_all args]}
shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/report.txt" 2>&1 || echo "pip install failed"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  polyaccel report
} >>"$OUT/report.txt" 2>&1
python3 benchmarks/verify_cuda.py --out "$OUT/verify.json" ${VERIFY_ARGS:-} >"$OUT/verify.log" 2>&1
echo "verify: exit $? ($(grep -c '^PASS' "$OUT/verify.log") passed, $(grep -c '^FAIL' "$OUT/verify.log") failed)"
grep '^FAIL' "$OUT/verify.log"
if [ -n "${SKIP_CONFORMANCE:-}" ]; then
  echo "conformance: skipped (SKIP_CONFORMANCE set)"
elif polyaccel conformance --help >/dev/null 2>&1; then
  polyaccel conformance --accelerator cuda --json "$OUT/conformance.json" >"$OUT/conformance.log" 2>&1
  echo "conformance: exit $?"
  tail -5 "$OUT/conformance.log"
else
  echo "conformance: no 'polyaccel conformance' command in this tree" | tee "$OUT/conformance.log"
fi
python3 benchmarks/run_all.py --out "$OUT/bench.json" "$@" >"$OUT/bench.log" 2>&1
echo "run_all: exit $?"
tail -60 "$OUT/bench.log"
