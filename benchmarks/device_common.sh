# Sourced by the device scripts: start_call OUTDIR (the output folder made, OUT its absolute path, the device
# environment set, polyaccel installed from this tree with the wheels under .whl/ when present, e.g. Liger-Kernel),
# and run(): one step under its own time limit.
start_call() {
  mkdir -p "$1"
  OUT=$(cd "$1" && pwd)
  export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TORCH_CUDA_ARCH_LIST=9.0
  install_polyaccel
}
install_polyaccel() {
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || echo "pip install failed (see install.log)"
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl >>"$OUT/install.log" 2>&1 \
      || echo "wheel install failed"
  fi
}
run() {  # name, limit, command...: the command's output to OUT/name.log, its exit status and time, its tail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s"
  tail -"${TAIL:-30}" "$OUT/$name.log"
}
