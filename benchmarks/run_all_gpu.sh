#!/usr/bin/env bash
# One device call (nvidia-h200-x2) for every GPU benchmark: logs and JSON under $OUT, a summary table last.
# Usage on the device, from the repo root:  bash benchmarks/run_all_gpu.sh
RUN_TAIL=25
source "$(dirname "$0")/gpu_env.sh"
run train_step 150 python3 benchmarks/train_step.py --out "$OUT"
run health_gpu 60 torchrun --nproc-per-node 2 benchmarks/health_gpu.py --max-bytes $((2 << 30)) --expect-busbw 338.0 --json "$OUT/health_a2a.json"
run ep_train 110 torchrun --nproc-per-node 2 benchmarks/ep_train.py --out "$OUT"
run pp_train 80 torchrun --nproc-per-node 2 benchmarks/pp_train.py --out "$OUT"
cat "$OUT/gpus.txt"
