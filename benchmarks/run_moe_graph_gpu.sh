#!/usr/bin/env bash
# The expert stage replayed from CUDA graphs (model.moe.cuda_graph) against eager, on one GPU; logs + JSON under $OUT.
#   bash benchmarks/run_moe_graph_gpu.sh layer     the GPU test (graphed == eager bit for bit), then the layer at
#                                                  both shape sets of benchmarks/moe_shapes.py (COMMON_ONLY /
#                                                  MODELS_ONLY: its --only), every row against the naive pipeline
#   bash benchmarks/run_moe_graph_gpu.sh trainer   the 16-layer trainer at 1k and 2k tokens per micro-batch, eager
#                                                  and graphed, same data (the losses must agree)
#   bash benchmarks/run_moe_graph_gpu.sh product   moe-launch model.moe.cuda_graph=true (the default run otherwise),
#                                                  then the trainer at 4k tokens per micro-batch, eager and graphed
source "$(dirname "$0")/gpu_env.sh"
case "${1:-layer}" in
  layer)
    run gpu_moe_graph 180 python3 tests/kernels/gpu_moe_graph.py
    run shapes_common 280 python3 benchmarks/moe_shapes.py --out "$OUT" --only "${COMMON_ONLY:-}"
    run shapes_models 240 python3 benchmarks/moe_shapes.py --out "$OUT" --set models --only "${MODELS_ONLY:-}"
    cat "$OUT/gpu_moe_graph.log"
    grep -E "check |ERROR|failed|Error|rc=" "$OUT/shapes_common.log" "$OUT/shapes_models.log" | cut -c1-300
    sed -n '/^dense rates measured/,$p' "$OUT/moe_shapes.log"
    sed -n '/^dense rates measured/,$p' "$OUT/moe_shapes-models.log" ;;
  trainer)
    run trainer_throughput 560 python3 benchmarks/trainer_throughput.py --out "$OUT" --steps 10 \
      --only olmoe-16L-1k-8mb,olmoe-16L-1k-8mb-graph,olmoe-16L-2k-8mb,olmoe-16L-2k-8mb-graph
    tail -8 "$OUT/trainer_throughput.log" ;;
  product)
    bash benchmarks/local_gpu_run.sh model.moe.cuda_graph=true
    cd "$(dirname "$0")/.." || exit 1
    run trainer_throughput 330 python3 benchmarks/trainer_throughput.py --out "$OUT" --steps 10 \
      --only olmoe-16L-4k-8mb,olmoe-16L-4k-8mb-graph
    tail -6 "$OUT/trainer_throughput.log" ;;
esac
cat "$OUT/gpus.txt"
