#!/usr/bin/env bash
# QK-norm + RoPE as one kernel (model.qk_norm_rope_fusion) against the compiled modules, in one device call (logs +
# JSON under $OUT): the kernel's GPU check (tests/kernels/gpu_norm_rope.py: against fp64, and the compiled model on
# both settings), the kernel and the attention sublayer timed (benchmarks/norm_rope.py), then the trainer on both
# settings with FP8 experts: the 4-layer model at four micro-batches of 16x4096 tokens, which fits an H100's 80 GB
# as well as an H200. Prints each part's last lines and the trainer rows.
source "$(dirname "$0")/gpu_env.sh"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' \
  | tee "$OUT/versions.txt"
RUN_TAIL=6
(cd tests/kernels && run gpu_norm_rope 150 python3 gpu_norm_rope.py)
run norm_rope_bench 120 python3 benchmarks/norm_rope.py --out "$OUT"
RUN_TAIL=0
run trainer "${TRAINER_S:-300}" python3 benchmarks/trainer_throughput.py --out "$OUT" --steps 9 \
  --only "olmoe-4L-fp8-16x-4mb-qk-fused,olmoe-4L-fp8-16x-4mb-qk-modules"
grep -h '"case"' "$OUT/trainer.log" | python3 -c 'import sys, json
for d in map(json.loads, sys.stdin):
    print(d["case"], d.get("tokens_per_s"), d.get("peak_gib"), d.get("final_loss"), "rc", d["rc"])'
tail -n 6 "$OUT/trainer.log"
cat "$OUT/gpus.txt"
