#!/usr/bin/env bash
# `moe-launch` with no arguments (cluster=local, the default layout) on a GPU machine: the product path a new user
# takes first. Records the layout note, the journal, the summary and GPU memory seen during the run under $OUT.
# Run from the repository root on the device: bash benchmarks/local_gpu_run.sh [HYDRA_OVERRIDE...] (none: the
# no-argument run; e.g. model.moe.cuda_graph=true to take an option through the same path)
source "$(dirname "$0")/gpu_env.sh"
work=$(mktemp -d); cd "$work" || exit 1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus_seen.txt"
(while sleep 2; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done) >"$OUT/mem_used_mib.txt" &
sampler=$!
t0=$(date +%s)
launcher=$(command -v moe-launch || echo "python3 -m moe_launch.orchestrator.cli")
timeout -k 5 "${RUN_LIMIT_S:-150}" $launcher "$@" >"$OUT/moe_launch.log" 2>&1; rc=$?
t1=$(date +%s); kill $sampler
run=$(ls -d runs/*/ | head -1)
cp "$run/journal.jsonl" "$run/summary.json" "$OUT/" 2>/dev/null
tail -n 30 "$run"/logs/attempt0/*.log >"$OUT/trainer_tail.log" 2>/dev/null
echo "=== moe-launch ${*:-(no arguments)} exit $rc in $((t1 - t0)) s; peak GPU memory used $(sort -n "$OUT/mem_used_mib.txt" | tail -1) MiB"
grep -E "GPU|warning|run (completed|failed|stopped)" "$OUT/moe_launch.log" | cut -c1-300
python3 -c "import json,sys; s=json.load(open('$OUT/summary.json')); print({k: s.get(k) for k in ('status','steps_done','final_loss','restarts','final_nodes')})"
