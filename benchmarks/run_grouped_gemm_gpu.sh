#!/usr/bin/env bash
# Our persistent TMA grouped GEMM against torch's CUTLASS ones, in one device call (1×H200; logs + JSON under $OUT):
#   the compiled kernel's correctness check (tests/kernels/gpu_grouped_gemm_tma.py; SKIP_CHECK=1 leaves it out);
#   each GEMM alone per tile (benchmarks/grouped_gemm_tiles.py; SKIP_TILES=1 leaves it out; TILES_ONLY picks its
#     GEMMs by comma-separated name parts);
#   the fused SwiGLU GEMMs against the stages they replace, per tile (benchmarks/swiglu_gemm_tiles.py; SKIP_FUSED=1
#     leaves it out; FUSED_ONLY picks its shapes);
#   the expert layer with its row GEMMs on each path of GEMM_IMPLS (benchmarks/moe_shapes.py --gemm-impl; default
#     "torch tma") at the shapes MOE_SHAPES_ONLY names (comma-separated name parts; default below) of the shape
#     set MOE_SET (common | models), or at the shapes MOE_SHAPES gives instead (space-separated T,D,F,E,K), our rows
#     MOE_ROWS (moe_shapes.py --rows; default all);
#   TRAINER_CASES (comma-separated benchmarks/trainer_throughput.py cases; none by default), e.g. a case beside its
#     "-cutlass" twin (model.moe.grouped_gemm=torch);
#   PRODUCT=1: then `moe-launch` with no arguments (benchmarks/local_gpu_run.sh).
source "$(dirname "$0")/gpu_env.sh"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' \
  | tee "$OUT/versions.txt"
impls=${GEMM_IMPLS:-torch tma}
if [ -z "${SKIP_CHECK:-}" ]; then
  run gpu_grouped_gemm_tma 200 python3 tests/kernels/gpu_grouped_gemm_tma.py
  head -c 600 "$OUT/gpu_grouped_gemm_tma.log"; echo
fi
[ -z "${SKIP_TILES:-}" ] && run grouped_gemm_tiles 300 python3 benchmarks/grouped_gemm_tiles.py --out "$OUT" \
  --only "${TILES_ONLY:-}"
[ -z "${SKIP_FUSED:-}" ] && run swiglu_gemm_tiles "${FUSED_S:-300}" python3 benchmarks/swiglu_gemm_tiles.py --out "$OUT" \
  --only "${FUSED_ONLY:-}"
# which shapes the layer runs at, and the stem of the log moe_shapes.py names after them
shape_args=(--only "${MOE_SHAPES_ONLY:-OLMoE-1B-7B,coarse,fine: 128}" --set "${MOE_SET:-common}") stem=moe_shapes
[ "${MOE_SET:-common}" = models ] && stem=moe_shapes-models
if [ -n "${MOE_SHAPES:-}" ]; then
  shape_args=() stem=moe_shapes-given
  for s in $MOE_SHAPES; do shape_args+=(--shape "$s"); done
fi
for impl in $impls; do
  run "moe_shapes-$impl" "${MOE_SHAPES_S:-200}" python3 benchmarks/moe_shapes.py --out "$OUT" \
    "${shape_args[@]}" --gemm-impl "$impl" --rep-ms "${REP_MS:-200}" --rows "${MOE_ROWS:-}"
done
if [ -n "${TRAINER_CASES:-}" ]; then
  run trainer_throughput "${TRAINER_S:-330}" python3 benchmarks/trainer_throughput.py --out "$OUT" --steps 10 \
    --only "$TRAINER_CASES"
fi
grep -E "WRONG|failed|Error" "$OUT"/grouped_gemm_tiles.log 2>/dev/null | cut -c1-300 | head -20
sed -n '/^| GEMM/,$p' "$OUT/grouped_gemm_tiles.log" 2>/dev/null
grep -E "WRONG|failed|Error|rc=" "$OUT"/swiglu_gemm_tiles.log 2>/dev/null | cut -c1-300 | head -20
sed -n '/^| shape/,$p' "$OUT/swiglu_gemm_tiles.log" 2>/dev/null
for impl in $impls; do
  f="$OUT/$stem-$impl.log"; [ "$impl" = auto ] && f="$OUT/$stem.log"
  echo "=== layer, row GEMMs: $impl"; grep -E "ABOVE|failed|rc=" "$OUT/moe_shapes-$impl.log" | cut -c1-300
  grep -E "^\| " "$f" | grep -vE "\|---" | cut -d'|' -f2,5,6,10 | cut -c1-160
done
[ -n "${TRAINER_CASES:-}" ] && tail -n 8 "$OUT/trainer_throughput.log"
cat "$OUT/gpus.txt"
if [ -n "${PRODUCT:-}" ]; then RUN_LIMIT_S=150 bash "$(dirname "$0")/local_gpu_run.sh"; fi
