#!/usr/bin/env bash
# One device call for the model kernels (issue 46) and AutoSP's one-GPU row (issue 47): install polyaccel (and
# Liger-Kernel from .whl when present), then run each named step under its own limit, logging to OUTDIR/<step>.log.
#   bash benchmarks/kernels_device.sh OUTDIR STEP...
# Steps:
#   conf      conformance of the model-kernel ops on cuda (real GPU numerics of the Triton builders)
#   kernels   model_kernels_gpu.py: every section at Llama-3-8B shapes (polyaccel, HF eager, torch.compile, Liger)
#   zero1b    zero_gpu.py 1B stage 3: polyaccel with and without kernels, FSDP2, FSDP2 + Liger (isolated rows)
#   zero220m  zero_gpu.py 220M stage 1 with and without kernels against the torch fused-AdamW baseline
#   sp1       zero_gpu.py 220M stages 1 and 3 with the sequence_parallel layer at size 1 (AutoSP's no-op target)
#   prof220   zero_profile.py, 220M stage 1 without and with the kernels: where the step's time goes, GPU busy share
#   fit       kernels_fit.py: the largest batch x 4096 each system trains at vocab 128k (hf, liger, polyaccel +- kernels)
# KERNEL_FLAGS adds flags to the kernels step (e.g. "--tune --profile --sections rope,linear_cross_entropy").
# ROUNDS=N sets zero_gpu's rounds of the 220M rows (default 2), ROUNDS_1B those of the 1B rows (default 1);
# SP1_ONLY the configurations of the sp1 step (default "=stage 1,=stage 3").
set -u
OUT=${1:?usage: kernels_device.sh OUTDIR STEP...}
shift
ROUNDS=${ROUNDS:-2}
ROUNDS_1B=${ROUNDS_1B:-1}
SP1_ONLY=${SP1_ONLY:-=stage 1,=stage 3}
. "$(dirname "$0")/device_common.sh"
start_call "$OUT"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
  'transformers', transformers.__version__, torch.cuda.get_device_name())"
for step in "$@"; do
  case $step in
    conf) TAIL=12 run conf 300 polyaccel conformance --accelerator cuda --timeout 280 \
            -k "rms_norm or rope or linear_cross_entropy or logprobs or entropy or kl" --json "$OUT/conf.json" ;;
    kernels) (cd benchmarks && TAIL=${TAIL_K:-40} run kernels 300 python3 model_kernels_gpu.py ${KERNEL_FLAGS:-} \
              --json "$OUT/kernels.json") ;;
    prof220) (cd benchmarks && for k in "" --kernels; do
                 TAIL=3 run "prof220${k:+_kernels}" 120 python3 zero_profile.py --stage 1 $k --rows 40; done) ;;
    fit) (cd benchmarks && TAIL=8 run fit 360 python3 kernels_fit.py --out "$OUT/fit.json") ;;
    zero1b) (cd benchmarks && TAIL=30 run zero1b 400 python3 zero_gpu.py --size 1b --kernels --isolate --rounds "$ROUNDS_1B" \
              --only "=stage 3" --no-granular --peers fsdp2 --steps 5 --out "$OUT/zero1b.json") ;;
    zero220m) (cd benchmarks && TAIL=20 run zero220m 300 python3 zero_gpu.py --kernels --isolate --rounds "$ROUNDS" \
              --only "=stage 1" --no-granular --peers "" --steps 6 --out "$OUT/zero220m.json") ;;
    sp1) (cd benchmarks && TAIL=20 run sp1 300 python3 zero_gpu.py --sp1 --peers "" --only "$SP1_ONLY" \
              --no-granular --isolate --rounds "$ROUNDS" --steps 6 --out "$OUT/sp1.json") ;;
    *) echo "unknown step $step" ;;
  esac
done
