#!/usr/bin/env bash
# One device call for the ZeRO benchmarks: install polyaccel (and DeepSpeed from .wheels when
# present), then run each named step under its own time limit, logging to OUTDIR/<step>.log.
#   bash benchmarks/zero_device_run.sh OUTDIR STEP...
# Steps: peers220m peers1b iso220m iso3r isooff phases2 overlap2 overlap1 overlap1w memory memoff memsnap overlap3 profile1 profile3
#        profile3b profile3o profile3g verify
#        ckpt largest largestpa largestds largestfsdp host w1 w1b iso1b off220 off1b offratio220 offratio1b largest22
#        param1b
set -u
OUT=${1:?usage: zero_device_run.sh OUTDIR STEP...}
shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 LIMIT=${LIMIT:-240}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || echo "polyaccel install failed"
if [ -d .wheels ]; then
  python3 -m pip install -q --no-index --no-deps .wheels/*.whl >>"$OUT/install.log" 2>&1 || echo "deepspeed install failed"
fi
cd benchmarks
run() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  timeout "$LIMIT" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s"
  tail -25 "$OUT/$name.log"
}
for step in "$@"; do
  case $step in
    peers220m) run peers220m python3 zero_gpu.py --out "$OUT/zero220m.json" ;;
    peers1b) run peers1b python3 zero_gpu.py --size 1b --no-granular --steps 5 --out "$OUT/zero1b.json" ;;
    iso220m) run iso220m python3 zero_gpu.py --isolate --steps 6 --out "$OUT/iso220m.json" ;;
    iso3r) run iso3r python3 zero_gpu.py --isolate --rounds 3 --only "stage 3" --no-granular --peers fsdp2 --steps 8 \
             --out "$OUT/iso3r.json" ;;
    isooff) run isooff python3 zero_gpu.py --isolate --only offload --no-granular --steps 4 --out "$OUT/isooff.json" ;;
    phases2) run phases2 python3 zero_offload_phases.py --stage 2 ;;
    overlap2) run overlap2 python3 zero_offload_phases.py --stage 2 --overlap ;;
    memory) run memory python3 zero_memory.py ;;
    memoff) run memoff python3 zero_memory.py --offload --stages 1,2,3 ;;
    memsnap) run memsnap python3 zero_memory.py --stages 2,3 --snapshot "$OUT/snapshots" ;;
    overlap3) run overlap3 python3 zero_offload_phases.py --stage 3 --overlap ;;
    profile3o) run profile3o python3 zero_profile.py --stage 3 --offload --rows 25 ;;
    profile3) run profile3 python3 zero_profile.py --stage 3 ;;
    profile1) run profile1 python3 zero_profile.py --stage 1 ;;
    profile3b) run profile3b python3 zero_profile.py --stage 3 --size 1b --rows 25 ;;
    overlap1) run overlap1 python3 zero_offload_phases.py --stage 1 --overlap ;;
    overlap1w) run overlap1w python3 zero_offload_phases.py --stage 1 --overlap --worker-threads 12 ;;
    verify) run verify python3 verify_cuda.py --skip-large --out "$OUT/verify.json" ;;
    profile3g) run profile3g python3 zero_profile.py --stage 3 --granularity 60000000 ;;
    ckpt) run ckpt python3 activation_checkpoint_gpu.py --out "$OUT/ckpt.json" ;;
    largest) run largest python3 zero_largest.py --budget $((LIMIT - 15)) --out "$OUT/largest.json" ;;
    largestpa) run largestpa python3 zero_largest.py --systems polyaccel --start 34 --budget $((LIMIT - 15)) \
                 --out "$OUT/largestpa.json" ;;
    largestds) run largestds python3 zero_largest.py --systems deepspeed --start 30 --budget $((LIMIT - 15)) \
                 --trial-timeout $((LIMIT - 20)) --out "$OUT/largestds.json" ;;
    largestfsdp) run largestfsdp python3 zero_largest.py --systems fsdp2 --start 34 --budget $((LIMIT - 15)) \
                   --out "$OUT/largestfsdp.json" ;;
    host) for s in 1 3; do run host$s python3 zero_host.py --stage $s --steps 3 --rows 12 --trace "$OUT/trace$s.json.gz"; done ;;
    w1) run w1 python3 zero_gpu.py --isolate --rounds 3 --only "=stage 1,=stage 3" --no-granular --peers '' --steps 8 \
          --out "$OUT/w1.json" ;;
    w1b) run w1b python3 zero_gpu.py --isolate --rounds 2 --size 1b --only "=stage 1,=stage 3" --no-granular \
           --peers fsdp2 --steps 5 --out "$OUT/w1b.json" ;;
    iso1b) run iso1b python3 zero_gpu.py --isolate --rounds 2 --size 1b --only "stage 3" --no-granular --peers fsdp2 \
             --steps 5 --out "$OUT/iso1b.json" ;;
    off220) run off220 python3 zero_gpu.py --isolate --rounds 1 --no-granular --peers '' --steps 6 \
              --only "=stage 1,=stage 2,=stage 1 + offload_optimizer,=stage 2 + offload_optimizer" --out "$OUT/off220.json" ;;
    off1b) run off1b python3 zero_gpu.py --isolate --size 1b --no-granular --peers fsdp2 --steps 4 \
             --only "=stage 1,=stage 1 + offload_optimizer,=stage 3 + offload_optimizer + offload_param" \
             --out "$OUT/off1b.json" ;;
    offratio220) run offratio220 python3 zero_gpu.py --isolate --rounds 1 --no-granular --peers '' --steps 6 \
                   --only "=stage 1,=stage 1 + offload_optimizer" --ratio 0.5,0.8 --out "$OUT/offratio220.json" ;;
    offratio1b) run offratio1b python3 zero_gpu.py --isolate --size 1b --no-granular --peers '' --steps 4 \
                  --only "=stage 1,=stage 1 + offload_optimizer" --ratio 0.5 --out "$OUT/offratio1b.json" ;;
    param1b) run param1b python3 zero_gpu.py --isolate --rounds 3 --size 1b --no-granular --peers fsdp2 --steps 4 \
               --only "=stage 3 + offload_optimizer + offload_param" --out "$OUT/param1b.json" ;;
    largest22) run largest22 python3 zero_largest.py --systems polyaccel,fsdp2 --start 22 --max-layers 22 \
                 --budget $((LIMIT - 15)) --out "$OUT/largest22.json" ;;
    *) echo "unknown step $step" ;;
  esac
done
