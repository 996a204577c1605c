#!/usr/bin/env bash
# Our persistent TMA grouped GEMM against torch's CUTLASS ones, in one device call (1×H200; logs + JSON under $OUT):
# the compiled kernel's correctness check (tests/kernels/gpu_grouped_gemm_tma.py), each GEMM alone per tile
# (benchmarks/grouped_gemm_tiles.py), then the expert layer with its row GEMMs on each path (benchmarks/moe_shapes.py
# --gemm-impl torch / tma / auto) at the shapes in MOE_SHAPES_ONLY (comma-separated name parts; default below).
source "$(dirname "$0")/gpu_env.sh"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' \
  | tee "$OUT/versions.txt"
only=${MOE_SHAPES_ONLY:-"OLMoE-1B-7B,coarse,fine: 128"}
run gpu_grouped_gemm_tma 200 python3 tests/kernels/gpu_grouped_gemm_tma.py
head -c 3000 "$OUT/gpu_grouped_gemm_tma.log"; echo
if [ -z "${SKIP_TILES:-}" ]; then
  run grouped_gemm_tiles 300 python3 benchmarks/grouped_gemm_tiles.py --out "$OUT"
fi
for impl in ${GEMM_IMPLS:-torch tma}; do
  run "moe_shapes-$impl" "${MOE_SHAPES_S:-200}" python3 benchmarks/moe_shapes.py --out "$OUT" --only "$only" \
    --gemm-impl "$impl" --rep-ms "${REP_MS:-200}"
done
grep -E "WRONG|failed|Error" "$OUT"/grouped_gemm_tiles.log 2>/dev/null | cut -c1-300 | head -20
sed -n '/^| GEMM/,$p' "$OUT/grouped_gemm_tiles.log" 2>/dev/null
for impl in ${GEMM_IMPLS:-torch tma}; do
  f="$OUT/moe_shapes-$impl.log"; [ "$impl" = auto ] && f="$OUT/moe_shapes.log"
  echo "=== layer, row GEMMs: $impl"; grep -E "ABOVE|failed|rc=" "$f" | cut -c1-300
  grep -E "^\| " "$f" | grep -vE "\|---" | cut -d'|' -f2,5,6,10 | cut -c1-160
done
cat "$OUT/gpus.txt"
