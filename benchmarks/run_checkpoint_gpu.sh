#!/usr/bin/env bash
# Checkpoint cost on the device, in one call (1×H200; logs + JSON under $OUT):
#   1. throughput through `moe-launch` at the 4-layer OLMoE shape, without and with a full checkpoint every 10 steps
#   2. benchmarks/checkpoint.py (ours: stall, time to durable against the disk bound, restore), if time is left
# GOODPUT_ARGS / CKPT_ARGS (default --skip-dcp) / CKPT_S: more arguments and the time limit of step 2
source "$(dirname "$0")/gpu_env.sh"
RUN_TAIL=${RUN_TAIL:-14}
run checkpoint_goodput 330 python3 benchmarks/checkpoint_goodput.py --out "$OUT" --budget-s 160 ${GOODPUT_ARGS:-}
rm -rf /tmp/ckpt-goodput-*  # 2 x 26 GB of checkpoints: the disk holds about 64 GB
run checkpoint ${CKPT_S:-150} python3 benchmarks/checkpoint.py --out "$OUT" --dir /tmp/ckpt-bench ${CKPT_ARGS:---skip-dcp}
rm -rf /tmp/ckpt-bench
cat "$OUT/gpus.txt"
