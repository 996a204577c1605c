#!/usr/bin/env bash
# The MoE expert layer at common shapes, in one device call (1×H200; log + JSON under $OUT): first
# benchmarks/fp8_gemms.py (each grouped GEMM alone, bf16 / FP8 as torch tiles it / FP8 with rows presented), then
# benchmarks/moe_shapes.py runs OLMoE-1B-7B, a Mixtral-like coarse layer, 128 and 256 fine-grained experts, skewed
# routing and small token counts, each with ours bf16, ours FP8 (weights quantized per call, and reused) and the
# naive bf16 pipeline (checked against it, then timed fwd+bwd). Prints the per-shape checks and failures, then the
# table.
# MOE_SHAPES_S: the benchmark's time limit (seconds); MOE_SHAPES_ONLY: comma-separated name parts of the shapes to
# run (all when unset), e.g. "OLMoE-1B-7B,T 1024".
#   run_moe_shapes_gpu.sh given T,D,F,E,K ...   the layer at the shapes given instead (no GEMM sweep), with the rows
#                                                of MOE_SHAPES_ROWS (default bf16,fp8-reused,graph)
source "$(dirname "$0")/gpu_env.sh"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(),
      torch.cuda.get_device_capability())' | tee "$OUT/versions.txt"
if [ "${1:-}" = given ]; then
  shift
  args=(); for s in "$@"; do args+=(--shape "$s"); done
  run moe_shapes-given-stdout "${MOE_SHAPES_S:-300}" python3 benchmarks/moe_shapes.py --out "$OUT" \
    --rows "${MOE_SHAPES_ROWS:-bf16,fp8-reused,graph}" --rep-ms 300 "${args[@]}"
  log="$OUT/moe_shapes-given.log"
else
  run fp8_gemms 150 python3 benchmarks/fp8_gemms.py --out "$OUT"
  run moe_shapes "${MOE_SHAPES_S:-300}" python3 benchmarks/moe_shapes.py --out "$OUT" --only "${MOE_SHAPES_ONLY:-}"
  grep -v "kernel:" "$OUT/fp8_gemms.log" | cut -c1-300
  log="$OUT/moe_shapes.log"
fi
grep -E "check |ERROR|failed|Error|^dense bf16|load \{|\([0-9.]+ s\)" "$log" | cut -c1-400
sed -n '/^dense rates measured/,$p' "$log"
cat "$OUT/gpus.txt"
