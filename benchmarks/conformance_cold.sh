#!/usr/bin/env bash
# The cuda conformance run with an empty Triton cache (issue 49's target: <= 90 s), then warm, in one call.
#   bash benchmarks/conformance_cold.sh OUTDIR
# Both in one process (--workers 1), so the seconds per op add up to the run's. Writes OUTDIR/conf_cold.json
# and OUTDIR/conf_warm.json (docs/conformance-json.md) and prints each run's total, its counts, the seconds
# per op (cold and warm: the difference is mostly Triton compiling) and the slowest rows. Then, with
# WORKERS=N > 1 (default: the command's own default, "auto"; WORKERS=1 skips it), a third run with another
# empty cache in N processes (the command's default count) -> OUTDIR/conf_cold_workers.json.
# The compiles the cold run triggers are counted on a CPU by benchmarks/conformance_compiles.py.
set -u
OUT=${1:?usage: conformance_cold.sh OUTDIR}
. "$(dirname "$0")/device_common.sh"
start_call "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
      torch.cuda.get_device_name())"
TRITON_CACHE_DIR=$(mktemp -d)
export TRITON_CACHE_DIR
for run in cold warm; do
  t0=$SECONDS
  polyaccel conformance --accelerator cuda --workers 1 --timeout 580 --json "$OUT/conf_$run.json" \
    >"$OUT/conf_$run.log" 2>&1
  echo "== $run: exit $? in $((SECONDS - t0)) s (wall, process start included)"
  tail -1 "$OUT/conf_$run.log"
done
echo "Triton cache after the cold run: $(find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l) cubins"
WORKERS=${WORKERS:-auto}
if [ "$WORKERS" != 1 ]; then
  count=()
  [ "$WORKERS" = auto ] || count=(--workers "$WORKERS")
  t0=$SECONDS
  TRITON_CACHE_DIR=$(mktemp -d) polyaccel conformance --accelerator cuda "${count[@]}" --timeout 580 \
    --json "$OUT/conf_cold_workers.json" \
    >"$OUT/conf_cold_workers.log" 2>&1
  echo "== cold, $WORKERS processes: exit $? in $((SECONDS - t0)) s (wall, process start included)"
  tail -1 "$OUT/conf_cold_workers.log"
fi
python3 - "$OUT/conf_cold.json" "$OUT/conf_warm.json" <<'EOF'
import json
import sys
from collections import defaultdict

docs = [json.load(open(p)) for p in sys.argv[1:]]
for name, d in zip(("cold", "warm"), docs):
    print(f"{name}: {d['duration_s']:.1f} s, {d['counts']}")
per_op = [defaultdict(float) for _ in docs]
for acc, d in zip(per_op, docs):
    for r in d["rows"]:
        acc[f"{r['area']}/{r['subject']}"] += r["duration_s"] or 0.0
print(f"{'seconds per subject':<40} {'cold':>7} {'warm':>7}")
for key in sorted(per_op[0], key=lambda k: -per_op[0][k]):
    print(f"{key:<40} {per_op[0][key]:7.2f} {per_op[1].get(key, 0.0):7.2f}")
print("slowest rows (cold):")
for r in sorted(docs[0]["rows"], key=lambda r: -(r["duration_s"] or 0))[:12]:
    print(f"{r['duration_s']:7.2f}  {r['id']}")
EOF
