#!/usr/bin/env bash
# The training-step measurements on the device, in two calls on nvidia-h200-x2 (each under the 10-minute limit); logs + JSON under $OUT.
#   bash benchmarks/run_training_gpu.sh step     train_step rows (GPU 0) + the real trainer at the OLMoE shapes
#   bash benchmarks/run_training_gpu.sh ep       EP=2 over both GPUs (bf16 params, compiled), then the real trainer
#                                               (GPU 0) beside the 200-step loss curve (GPU 1)
# and on one GPU, each mode one call, the fused output head against torch's passes in the same call:
#   bash benchmarks/run_training_gpu.sh head     the head benchmark, its GPU test, the 4-layer trainer cases
#   bash benchmarks/run_training_gpu.sh full     the 16-layer trainer cases, then HF's model at both shapes
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
  head)
    run gpu_xent 60 env PYTHONPATH="tests/kernels:$PYTHONPATH" python3 tests/kernels/gpu_cross_entropy.py
    run cross_entropy 120 python3 benchmarks/cross_entropy.py --out "$OUT"
    run trainer_throughput 380 python3 benchmarks/trainer_throughput.py --out "$OUT" --steps 10 \
      --only olmoe-4L-fp8-4mb,olmoe-4L-fp8-4mb-xent-torch,olmoe-4L-fp8-16x-4mb,olmoe-4L-fp8-16x-4mb-xent-torch,olmoe-4L-4mb,olmoe-4L-4mb-xent-torch
    tail -3 "$OUT/gpu_xent.log"; tail -14 "$OUT/cross_entropy.log"; tail -8 "$OUT/trainer_throughput.log" ;;
  full)
    run trainer_throughput 420 python3 benchmarks/trainer_throughput.py --out "$OUT" --steps 10 \
      --only olmoe-16L-fp8-4x-4mb,olmoe-16L-fp8-4x-4mb-xent-torch,olmoe-16L-4x-4mb
    run train_step 150 python3 benchmarks/train_step.py --out "$OUT" --budget-s 140 --only olmoe-4L/hf,olmoe-16L/hf
    tail -5 "$OUT/trainer_throughput.log"; grep -v '^{' "$OUT/train_step.log" | tail -12 ;;
esac
cat "$OUT/gpus.txt"
