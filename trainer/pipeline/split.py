"""Which layers go to which model chunk: a given split, or contiguous chunks balanced by parameter count. Pure.

The embedding always lives on chunk 0 and the final norm + output head on the last chunk (so the tokens enter and the
loss is computed where the data is). What is configurable is how they weigh in the balance (`parallel.pp_balance`,
costs from stage.balance_costs): `params` (parameter counts, the default: memory balance; an MoE layer counts all its
experts), `flops` (forward FLOPs per token: an MoE layer counts its top-k experts only, the embedding ~0, the output
head 2*D*V, about 1.5 OLMoE layers) or `layers` (layers only). Measured on 2 H200s with an 8-layer OLMoE, the head
cost about 0.6 of a layer's time (the MoE layers run further below peak than the head's one large GEMM), so `flops`
over-weighs it there ([5, 3] left stage 0 37% busier; `params` gave [4, 4], 15% the other way).
`parallel.pp_split` gives the layer count of every chunk explicitly (a chunk may hold 0 layers if it holds the
embedding or the head, e.g. [0, 4, 4] puts the embedding alone on the first stage).
"""

from __future__ import annotations

from moe_launch.errors import ConfigError


def check_split(split: list[int], n_layers: int, n_chunks: int) -> list[range]:
    if len(split) != n_chunks:
        raise ConfigError("parallel.pp_split", f"{len(split)} entries for {n_chunks} chunks (pp * pp_virtual_stages)",
                          f"give one layer count per chunk, {n_chunks} in all")
    if any(n < 0 for n in split) or sum(split) != n_layers:
        raise ConfigError("parallel.pp_split", f"{split} does not split {n_layers} layers",
                          f"use non-negative counts summing to model.n_layers={n_layers}")
    for c, n in enumerate(split):
        if n == 0 and 0 < c < n_chunks - 1:
            raise ConfigError("parallel.pp_split", f"chunk {c} would hold nothing",
                              "only the first (embedding) or last (head) chunk may have 0 layers")
    if n_chunks == 1 and split[0] == 0:
        raise ConfigError("parallel.pp_split", "the only chunk holds no layer", f"use [{n_layers}]")
    out, start = [], 0
    for n in split:
        out.append(range(start, start + n))
        start += n
    return out


def balanced_split(layer_costs: list[float], n_chunks: int, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> list[range]:
    """Contiguous chunks of >= 1 layer minimising the largest chunk cost (embedding / head costs added to the first /
    last chunk). Exact dynamic programme, O(C * L^2); ties go to the earliest split point so the result is stable."""
    L = len(layer_costs)
    if L < n_chunks:
        raise ConfigError("parallel.pp", f"{L} layers cannot fill {n_chunks} chunks (pp * pp_virtual_stages) of at "
                          "least one layer", "lower parallel.pp / pp_virtual_stages or give parallel.pp_split")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(chunk: int, lo: int, hi: int) -> float:
        extra = (first_extra if chunk == 0 else 0.0) + (last_extra if chunk == n_chunks - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    INF = float("inf")
    # best[k][i]: the smallest max-cost of placing layers [0, i) into chunks 0..k-1; cut[k][i] the last cut point
    best = [[INF] * (L + 1) for _ in range(n_chunks + 1)]
    cut = [[0] * (L + 1) for _ in range(n_chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, n_chunks + 1):
        for i in range(k, L - (n_chunks - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], cost(k - 1, j, i))
                if value < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], L
    for k in range(n_chunks, 0, -1):
        j = cut[k][i]
        bounds.append(range(j, i))
        i = j
    return bounds[::-1]


def chunk_layers(n_layers: int, n_chunks: int, split: list[int], layer_costs: list[float], first_extra: float,
                 last_extra: float) -> list[range]:
    """The layer range of every chunk: the given split if any, else balanced with these costs."""
    if split:
        return check_split(list(split), n_layers, n_chunks)
    return balanced_split(list(layer_costs), n_chunks, first_extra, last_extra)
