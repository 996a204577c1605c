"""Turn one metrics.jsonl record into TensorBoard tags. Pure, so what is logged is unit-testable.

Input keys (the metrics.jsonl record, trainer/metrics.py):
  loss, lm_loss, aux_loss, z_loss, grad_norm, lr, tokens_per_s, expert_load_max, expert_load_mean,
  aux_per_layer [L], z_per_layer [L], mfu, mfu_gemm, step_time_s, mem_gib,
  expert_counts [L][E]: (token, slot) pairs routed to each expert of each MoE layer in this step.
The held-out evaluation's records (eval.jsonl, trainer/evaluate.py) come through here too: eval_lm_loss,
eval_ppl, eval_sequences, eval_s.
Unknown numeric keys are logged under misc/ so nothing the trainer adds is silently dropped.
"""

from __future__ import annotations

import math
from typing import Any

TAGS = {
    "loss": "train/loss",
    "lm_loss": "train/lm_loss",
    "aux_loss": "moe/aux_loss",
    "z_loss": "moe/z_loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "mfu_gemm": "perf/mfu_vs_measured_gemm",
    "mem_gib": "perf/mem_gib",
    "step_time_s": "perf/step_time_s",
    "expert_load_max": "moe/load_max_over_mean",
    "expert_load_mean": "moe/load_mean_over_mean",
    "eval_lm_loss": "eval/lm_loss",
    "eval_ppl": "eval/ppl",
    "eval_sequences": "eval/sequences",
    "eval_s": "eval/seconds",
}
IGNORED = {"step", "time", "attempt"}
PER_LAYER = {"aux_per_layer": "aux_loss", "z_per_layer": "z_loss"}
COUNTS_KEY = "expert_counts"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def layer_load(counts_E: list[float]) -> tuple[float, float, list[float]]:
    """(max/mean, min/mean, per-expert load / mean) of one layer's counts; 1.0 everywhere is perfect balance."""
    mean = sum(counts_E) / max(len(counts_E), 1)
    if mean <= 0:
        return 0.0, 0.0, [0.0] * len(counts_E)
    rel = [c / mean for c in counts_E]
    return max(rel), min(rel), rel


def to_scalars(metrics: dict[str, Any]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(scalars tag -> value, histograms tag -> values). Non-finite and missing values are skipped."""
    scalars: dict[str, float] = {}
    hists: dict[str, list[float]] = {}
    for key, value in metrics.items():
        if key in IGNORED or key in PER_LAYER or key == COUNTS_KEY:
            continue
        if _number(value):
            scalars[TAGS.get(key, f"misc/{key}")] = float(value)
    for key, name in PER_LAYER.items():
        for i, value in enumerate(metrics.get(key) or []):
            if _number(value):
                scalars[f"moe/layer{i}/{name}"] = float(value)
    for i, counts_E in enumerate(metrics.get(COUNTS_KEY) or []):
        hi, lo, rel = layer_load([float(c) for c in counts_E])
        scalars[f"moe/layer{i}/load_max_over_mean"] = hi
        scalars[f"moe/layer{i}/load_min_over_mean"] = lo
        hists[f"moe/layer{i}/expert_load"] = rel
    return scalars, hists
