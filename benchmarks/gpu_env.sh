# Sourced by the device scripts (run_all_gpu.sh, run_training_gpu.sh): environment, editable install, GPU inventory
# and `run NAME SECONDS CMD...` (log to $OUT/NAME.log with its exit code; RUN_TAIL lines of it echoed afterwards).
# Needs the pure-Python deps the GPU image lacks (omegaconf, hydra, submitit) in .pydeps/ (carried), made with
#   pip install --target .pydeps --no-deps "omegaconf>=2.3,<2.4" "hydra-core>=1.3" submitit "antlr4-python3-runtime==4.9.3"
# (hydra-core 1.3 requires omegaconf < 2.4, which --no-deps does not check: 2.4 makes hydra print deprecation warnings).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/.pydeps:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv >"$OUT/gpus.txt" 2>&1
run() {  # run NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout -k 5 "$secs" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$?" >>"$OUT/$name.log"
  if [ "${RUN_TAIL:-0}" -gt 0 ]; then tail -n "$RUN_TAIL" "$OUT/$name.log"; fi
}
