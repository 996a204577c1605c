#!/usr/bin/env bash
# The expert stage replayed from CUDA graphs (model.moe.cuda_graph) against eager, on one GPU; logs + JSON under $OUT.
#   bash benchmarks/run_moe_graph_gpu.sh layer     the GPU test (graphed == eager bit for bit), then the layer at
#                                                  both shape sets of benchmarks/moe_shapes.py (COMMON_ONLY /
#                                                  MODELS_ONLY: its --only), every row against the naive pipeline
#   bash benchmarks/run_moe_graph_gpu.sh trainer   the 16-layer trainer at 1k and 2k tokens per micro-batch, eager
#                                                  and as the default (auto) runs it, same data (the losses must agree)
#   bash benchmarks/run_moe_graph_gpu.sh product   moe-launch with model.moe.cuda_graph=false, then with no arguments
#                                                  (auto graphs its small calls); both again with train.deterministic
#                                                  =true, where the two final losses must be equal
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
      --only "${TRAINER_ONLY:-olmoe-16L-1k-8mb-eager,olmoe-16L-1k-8mb,olmoe-16L-2k-8mb-eager,olmoe-16L-2k-8mb}"
    tail -8 "$OUT/trainer_throughput.log" ;;
  product)  # each run's files under /tmp (few files come back from $OUT): its printed summary and trainer tail kept
    for spec in "eager model.moe.cuda_graph=false" "default" \
                "eager_det model.moe.cuda_graph=false train.deterministic=true" "default_det train.deterministic=true"; do
      set -- $spec; name=$1; shift
      { OUT=/tmp/product/$name bash benchmarks/local_gpu_run.sh "$@"
        grep -hE "tok/s" /tmp/product/$name/trainer_tail.log | tail -n 3; } >"$OUT/product_$name.log" 2>&1
      cat "$OUT/product_$name.log"
    done ;;
esac
cat "$OUT/gpus.txt"
