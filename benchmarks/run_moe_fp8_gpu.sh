#!/usr/bin/env bash
# The MoE layer benchmark with the FP8 expert path, in one device call (1×H200; logs + JSON under $OUT):
# benchmarks/moe_layer.py checks every kernel on the GPU (the FP8 quantization bit-exact against its torch reference,
# the FP8 grouped GEMM against its fp32 emulation, the FP8 layer, no host sync), then times the bf16 and FP8 rows on
# the same tokens and each stage alone. Prints the FP8 checks, the correctness lines, the FP8 layer's kernels, the
# FP8 stages and the table.
# MOE_S: the benchmark's time limit (seconds).
source "$(dirname "$0")/gpu_env.sh"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(),
      torch.cuda.get_device_capability())' | tee "$OUT/versions.txt"
run moe_layer "${MOE_S:-330}" python3 benchmarks/moe_layer.py --out "$OUT"
log="$OUT/moe_layer.log"
grep -E "fp8 check|no host sync|ERROR|failed|^dense (bf16|FP8)|correctness" "$log" | cut -c1-400
sed -n '/kernels of one FP8/,+14p' "$log"
grep -E "stage (fp8|bf16 gathered|variant: fp8)|fp8 wgrad|stage fwd gmm gate|stage bwd wgrad gate" "$log"
sed -n '/^dense rates measured/,$p' "$log"
cat "$OUT/gpus.txt"
