#!/usr/bin/env bash
# One device call for the fused expert ops (issue 31): install, then
#   1. moe_experts_gpu.py: the fused builders (forced by override) vs AutoEP's unfused chain, expert MLP alone,
#      per row: errors vs fp64, ms per part and fwd+bwd, peak MB -> experts.log/.json
#   2. autoep_gpu.py: the 8 rows, AutoEP's default path vs HF eager / HF grouped_mm, plus AutoEP forced onto the
#      fused builders (the 'fused' columns) -> autoep.log, autoep.json
#   3. autoep_profile.py on the k=E row (E=8, 32k tokens, top-8): the default path and the fused one -> profile.log
# The fused builders rank below the reference (not chosen by default; plugins/cuda/ops.py TRITON_MOE_PRIORITY):
# step 1's 'x' column and step 2's 'x dflt' column are the numbers that would change that.
# Usage: bash benchmarks/moe_device.sh OUTDIR [steps]   (steps default 5; the three timeouts total 9.5 minutes)
set -u
OUT=${1:?usage: moe_device.sh OUTDIR [steps]}
STEPS=${2:-5}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || echo "pip install failed (see install.log)"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" >>"$OUT/install.log" 2>&1
cd benchmarks
timeout 150 python3 moe_experts_gpu.py --steps "$STEPS" --out "$OUT/experts.json" >"$OUT/experts.log" 2>&1
echo "moe_experts_gpu: exit $?"; cat "$OUT/experts.log"
timeout 330 python3 autoep_gpu.py --steps "$STEPS" --out "$OUT/autoep.json" >"$OUT/autoep.log" 2>&1
echo "autoep_gpu: exit $?"; cat "$OUT/autoep.log"
timeout 90 python3 autoep_profile.py --experts 8 --tokens 32768 --topk 8 --fused >"$OUT/profile.log" 2>&1
echo "autoep_profile: exit $?"; head -70 "$OUT/profile.log"
