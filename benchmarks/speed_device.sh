#!/usr/bin/env bash
# One device call for issue 49's rows (speed that holds on any machine): install polyaccel, then run each named step
# under its own limit, logging to OUTDIR/<step>.log. Run it in three separate calls and report all three.
#   bash benchmarks/speed_device.sh OUTDIR STEP...
# Steps:
#   confcold   polyaccel conformance --accelerator cuda with an empty Triton cache, default processes (<= 90 s)
#   autoep     autoep_gpu.py, all 8 rows (>= 1.3x HF grouped_mm, >= 2x HF eager; host ms and launches a step)
#   muon       zero_gpu.py --muon, 220M: ZeRO-1 and ZeRO-1 + offload_optimizer, Muon beside AdamW (<= 1.15x, <= 2x)
#   muon1b     the same at 1B, stage 1 only (<= 1.15x)
#   muonprof   zero_profile.py, 220M stage 1, AdamW then Muon: forward/backward/step apart and where the time goes
#              (host share, GC, allocator counts a phase; a Chrome trace each, gzipped)
#   nssweep    bench_muon.py --only zero --sweep: the Newton-Schulz of the ZeRO batches under each tile configuration
#   muonowner  bench_muon_owner.py, whole and per head: ZeRO Muon's owner's part, previous path vs in-place batches
#   offload1b  zero_gpu.py --size 1b: stage 3 + offload_optimizer + offload_param vs FSDP2 + CPUOffloadPolicy (<= 0.85x)
#   offthreads the same polyaccel row (no peer) with the host step's worker on 14 and 12 threads, beside offload1b's
# STEPS sets autoep_gpu's timed steps (default 5); ROUNDS zero_gpu's rounds (default 1).
set -u
OUT=${1:?usage: speed_device.sh OUTDIR STEP...}
shift
TAIL=${TAIL:-25}
STEPS=${STEPS:-5}
ROUNDS=${ROUNDS:-1}
. "$(dirname "$0")/device_common.sh"
start_call "$OUT"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'host CPUs', __import__('os').cpu_count())"
for step in "$@"; do
  case $step in
    confcold) TRITON_CACHE_DIR=$(mktemp -d) TAIL=4 run confcold 300 polyaccel conformance --accelerator cuda \
                --timeout 280 --json "$OUT/confcold.json" ;;
    autoep) (cd benchmarks && TAIL=40 run autoep 330 python3 autoep_gpu.py --steps "$STEPS" --out "$OUT/autoep.json") ;;
    muon) (cd benchmarks && run muon 300 python3 zero_gpu.py --muon --only "=stage 1,=stage 1 + offload_optimizer" \
             --peers "" --isolate --rounds "$ROUNDS" --steps 6 --out "$OUT/muon.json") ;;
    muon1b) (cd benchmarks && run muon1b 300 python3 zero_gpu.py --size 1b --muon --only "=stage 1" --peers "" \
               --isolate --rounds "$ROUNDS" --steps 5 --out "$OUT/muon1b.json") ;;
    muonprof) (cd benchmarks && for opt in "" --muon; do
                 TAIL=2 run "prof${opt:-_adamw}" 150 python3 zero_profile.py --stage 1 $opt --rows 30 \
                   --trace "$OUT/trace${opt:-_adamw}.json"; gzip -f "$OUT/trace${opt:-_adamw}.json"; done) ;;
    nssweep) (cd benchmarks && TAIL=4 run nssweep 280 python3 bench_muon.py --only zero --sweep \
                --out "$OUT/nssweep.json") ;;
    muonowner) (cd benchmarks && for heads in "" --per-head; do
                  TAIL=30 run "owner${heads:-_whole}" 200 python3 bench_muon_owner.py $heads \
                    --out "$OUT/owner${heads:-_whole}.json"; done) ;;
    offload1b) (cd benchmarks && run offload1b 360 python3 zero_gpu.py --size 1b \
                  --only "=stage 3 + offload_optimizer + offload_param" --no-granular --peers fsdp2 --isolate \
                  --rounds "$ROUNDS" --steps 5 --out "$OUT/offload1b.json") ;;
    offthreads) (cd benchmarks && for n in 14 12; do
                   TAIL=3 run "offthreads$n" 240 python3 zero_gpu.py --size 1b --host-threads "$n" \
                     --only "=stage 3 + offload_optimizer + offload_param" --no-granular --peers "" --isolate \
                     --rounds "$ROUNDS" --steps 5 --out "$OUT/offthreads$n.json"; done) ;;
    *) echo "unknown step $step" ;;
  esac
done
