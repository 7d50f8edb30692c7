#!/usr/bin/env bash
# One device call for the hostile-input work: conformance with the op-contract fuzz rows on cuda, the
# checkpoint checksum cost on the 220M model, a flipped byte in a cuda checkpoint, and verify_cuda.py.
#   bash benchmarks/trust_device_run.sh OUTDIR STEP...
# Steps: fuzz fuzzonly ckpt flip verify ds (ds: DeepSpeed ZeRO-2 / ZeRO-3 + offload through polyaccel and stock,
#        from wheels in .wheels: build them with `DS_BUILD_OPS=0 pip wheel --no-deps -w .wheels deepspeed==0.19.8`
#        plus hjson, pydantic, pydantic-core, annotated-types, typing-inspection for the device's Python)
set -u
OUT=${1:?usage: trust_device_run.sh OUTDIR STEP...}
shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TORCH_CUDA_ARCH_LIST=9.0
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || echo "polyaccel install failed"
run() {  # name, limit, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s"
  tail -${TAIL:-20} "$OUT/$name.log"
}
flip() {  # a cuda checkpoint with one byte flipped in a shard: verify and zero-to-fp32 must both refuse, naming it
  local d
  d=$(mktemp -d)
  polyaccel train --steps 4 --save "$d/ckpt" --metrics-out "$d/m.json" || return 1
  local shard
  shard=$(ls "$d"/ckpt/step4/zero_rank_*.safetensors | head -1)
  python3 - "$shard" <<'PY'
import os, sys
p = sys.argv[1]
with open(p, "r+b") as f:
    f.seek(os.path.getsize(p) // 2); b = f.read(1); f.seek(-1, 1); f.write(bytes([b[0] ^ 0x40]))
print("flipped one byte in", p)
PY
  polyaccel checkpoint verify "$d/ckpt"; echo "verify exit $?"
  polyaccel zero-to-fp32 "$d/ckpt" "$d/model.safetensors"; echo "zero-to-fp32 exit $?"
  rm -rf "$d"
}
for step in "$@"; do
  case $step in
    fuzzonly) run fuzz 300 polyaccel conformance --accelerator cuda --fuzz -k fuzz --json "$OUT/conformance-fuzz.json" ;;
    ds) python3 -m pip install -q --no-index --no-deps .wheels/*.whl >>"$OUT/install.log" 2>&1 || echo "wheel install failed"
        run ds 420 python3 tests/integrations/gpu_check.py --only deepspeed --out "$OUT/gpu_check.json" ;;
    fuzz) run fuzz 420 polyaccel conformance --accelerator cuda --fuzz --json "$OUT/conformance.json" ;;
    ckpt) run ckpt 300 python3 benchmarks/checkpoint_integrity.py --size 220m --rounds 5 --dir /tmp/ckbench \
            --out "$OUT/ckpt.json" ;;
    flip) export -f flip; run flip 240 bash -c flip ;;
    verify) run verify 240 python3 benchmarks/verify_cuda.py --out "$OUT/verify.json" ;;
    *) echo "unknown step $step" ;;
  esac
done
