#!/usr/bin/env bash
# One device call for the MoE expert ops (issue 31): install, then run each named step under its own limit,
# logging to OUTDIR/<step>.log.
#   bash benchmarks/moe_device.sh OUTDIR STEP...
# Steps:
#   conf      conformance (fixed cases and FUZZ fuzz examples a row, default 5: each new shape compiles Triton
#             kernels) of the swiglu ops, grouped_mm and the expert ops on cuda
#   autoep    autoep_gpu.py: the 8 rows, AutoEP's default path vs HF eager / HF grouped_mm -> autoep.json
#   rows32k   autoep_gpu.py on the two E=8, 32k-token rows only (top-2 and top-8), 10 timed steps
#   profile8  autoep_profile.py on the k=E row (E=8, 32k tokens, top-8): where AutoEP's device time goes
#   host4k    autoep_profile.py --host on the two host-bound rows (4k tokens, top-2, E=8 and 64), HF beside,
#             AutoEP with capture_graphs too
#   graphs4k  autoep_gpu.py on the two host-bound rows only (with the capture_graphs line), 10 timed steps
#   experts   moe_experts_gpu.py: the fused ops' chosen builders vs the unfused chain, expert MLP alone
# STEPS=N sets the timed steps of autoep/experts (default 5).
set -u
OUT=${1:?usage: moe_device.sh OUTDIR STEP...}
shift
STEPS=${STEPS:-5}
. "$(dirname "$0")/device_common.sh"
start_call "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for step in "$@"; do
  case $step in
    conf) run conf 400 polyaccel conformance --accelerator cuda --timeout 380 --fuzz --fuzz-examples "${FUZZ:-5}" -k "swiglu or grouped_mm or moe" \
            --json "$OUT/conf.json" ;;
    autoep) (cd benchmarks && run autoep 330 python3 autoep_gpu.py --steps "$STEPS" --out "$OUT/autoep.json") ;;
    rows32k) (cd benchmarks && run rows32k 150 python3 autoep_gpu.py --experts 8 --tokens 32768 --topk 2 8 --steps 10) ;;
    graphs4k) (cd benchmarks && run graphs4k 150 python3 autoep_gpu.py --experts 8 64 --tokens 4096 --topk 2 --steps 10) ;;
    profile8) (cd benchmarks && TAIL=45 run profile8 90 python3 autoep_profile.py --experts 8 --tokens 32768 --topk 8) ;;
    host4k) (cd benchmarks && for e in 8 64; do
               TAIL=90 run "host4k_e$e" 90 python3 autoep_profile.py --experts "$e" --tokens 4096 --topk 2 --hf --host \
                 --graphs --rows 22
             done) ;;
    experts) (cd benchmarks && run experts 150 python3 moe_experts_gpu.py --steps "$STEPS" --out "$OUT/experts.json") ;;
    *) echo "unknown step $step" ;;
  esac
done
