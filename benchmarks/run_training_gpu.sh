#!/usr/bin/env bash
# The training-step measurements on the device, in two calls on nvidia-h200-x2 (each under the 10-minute limit); logs + JSON under $OUT.
#   bash benchmarks/run_training_gpu.sh step     train_step rows (GPU 0) + the real trainer at the OLMoE shapes
#   bash benchmarks/run_training_gpu.sh ep       EP=2 over both GPUs (bf16 params, compiled), then the real trainer
#                                               (GPU 0) beside the 200-step loss curve (GPU 1)
source "$(dirname "$0")/gpu_env.sh"
case "${1:-step}" in
  step)
    CUDA_VISIBLE_DEVICES=0 run train_step 330 python3 benchmarks/train_step.py --out "$OUT" --profile --budget-s 300 \
      --only olmoe-4L/bf16,olmoe-4L/bf16c,olmoe-4L/hf,olmoe-16L/bf16c,olmoe-16L/hf,olmoe-16L/bf16c_acc4
    CUDA_VISIBLE_DEVICES=0 run trainer_throughput 230 python3 benchmarks/trainer_throughput.py --out "$OUT"
    grep -v '^{' "$OUT/train_step.log" | tail -45; tail -6 "$OUT/trainer_throughput.log" ;;
  ep)  # EP=2 on both GPUs, then the real trainer on GPU 0 beside the loss curve on GPU 1
    run ep_train 230 torchrun --nproc-per-node 2 benchmarks/ep_train.py --out "$OUT" --bf16-params --compile
    CUDA_VISIBLE_DEVICES=1 run loss_curve 320 python3 benchmarks/loss_curve.py --out "$OUT" &
    CUDA_VISIBLE_DEVICES=0 run trainer_throughput 230 python3 benchmarks/trainer_throughput.py --out "$OUT"
    wait
    grep '^\[' "$OUT/ep_train.log"; tail -3 "$OUT/ep_train.log"; tail -5 "$OUT/trainer_throughput.log"
    tail -15 "$OUT/loss_curve.log" ;;
esac
cat "$OUT/gpus.txt"
