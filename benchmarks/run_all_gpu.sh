#!/usr/bin/env bash
# One device call (nvidia-h200-x2) for every GPU benchmark: logs and JSON under $OUT, a summary table last.
# Usage on the device, from the repo root:  bash benchmarks/run_all_gpu.sh
# Needs the pure-Python deps the GPU image lacks (omegaconf, hydra, submitit) in .pydeps/ (carried).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/.pydeps:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv >"$OUT/gpus.txt" 2>&1
run() {  # run NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout -k 5 "$secs" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$?" >>"$OUT/$name.log"
  tail -n 25 "$OUT/$name.log"
}
run train_step 150 python3 benchmarks/train_step.py --out "$OUT"
run health_gpu 60 torchrun --nproc-per-node 2 benchmarks/health_gpu.py --max-bytes $((2 << 30)) --expect-busbw 338.0 --json "$OUT/health_a2a.json"
run ep_train 110 torchrun --nproc-per-node 2 benchmarks/ep_train.py --out "$OUT"
run pp_train 80 torchrun --nproc-per-node 2 benchmarks/pp_train.py --out "$OUT"
cat "$OUT/gpus.txt"
