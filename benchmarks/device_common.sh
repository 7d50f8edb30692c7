# Sourced by the *_device.sh scripts (OUT set to the output folder first): install polyaccel from this tree (and
# the wheels under .whl/ when present, e.g. Liger-Kernel), and run(): one step under its own time limit.
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
