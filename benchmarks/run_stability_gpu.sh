#!/usr/bin/env bash
# Training-health measurements on 1xH200 in one device call (benchmarks/stability.py says what each part measures).
# Run directories (with their checkpoints) stay on the device's /tmp; the JSON results and the log come back in $OUT.
source "$(dirname "$0")/gpu_env.sh"
run stability 280 python3 benchmarks/stability.py --out /tmp/stability --data-cache /tmp/stability-data \
  --only determinism,skew,balance
cp /tmp/stability/stability_*.json "$OUT/" 2>/dev/null
grep '^\[' "$OUT/stability.log"; grep -E 'Error|error' "$OUT/stability.log" | tail -5; tail -2 "$OUT/stability.log"
cat "$OUT/gpus.txt"
