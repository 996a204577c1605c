#!/usr/bin/env bash
# The FP8 loss curve in one device call (1×H200; log + JSON under $OUT): benchmarks/loss_curve.py --compare precision
# trains the small OLMoE-like MoE three times for 500 steps on the same data order (bf16, bf16 from another init seed,
# FP8 experts) and compares the FP8 gap with the bf16 run-to-run noise, over the training curves and on 128 held-out
# sequences of the corpus. Prints the versions, the per-run lines and the summary table (the verdict, then the exit
# code, last).
# LC_S: the benchmark's time limit (seconds); LC_STEPS: steps per run.
source "$(dirname "$0")/gpu_env.sh"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(),
      torch.cuda.get_device_capability())' | tee "$OUT/versions.txt"
run loss_curve_fp8 "${LC_S:-540}" python3 benchmarks/loss_curve.py --compare precision --steps "${LC_STEPS:-500}" \
  --out /tmp/loss_curve_fp8 --data-cache /tmp/loss_curve_data
cp /tmp/loss_curve_fp8/loss_curve_precision.json "$OUT/" 2>/dev/null
log="$OUT/loss_curve_fp8.log"
cat "$OUT/gpus.txt"
grep -E '^\[loss_curve\]' "$log"; grep -E 'Error|error' "$log" | tail -5
grep -q '^last [0-9]* of' "$log" && sed -n '/^last [0-9]* of/,$p' "$log" || tail -3 "$log"
