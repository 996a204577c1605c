"""Resume under another EP size (or PP split): model parameters and optimizer state reassembled by parameter name.

Every parameter keeps its full model's name in every layout; an expert parameter stacks its experts along dim 0,
and EP rank e of E holds experts [e n/E, (e+1) n/E). A saved optimizer bucket is the flat run of its parameters in
`param_names` order (each as its saved local slice), padded and cut into `shard_count` equal shards. So the saved
state of one parameter is found by walking the saved buckets with the saved parameters' sizes (read from the model
files' headers), and an expert parameter's global state is the concatenation of its EP slices in EP order. This rank
then takes the slices of its own parameters and fills its buckets' shards. Collective-free; every saved optimizer
file is read (once), which is fine for the rare resume that changes the layout.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from moe_launch.errors import CheckpointError
from moe_launch.trainer.checkpoint import layout
from moe_launch.trainer.checkpoint.resume import saved_rank_coords
from moe_launch.trainer.checkpoint.store import load_file, read_manifest

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
_EXPERT_FILE = re.compile(r"experts-ep(\d+)\.pt$")


def _saved_model_tensors(ckpt_dir: Path) -> dict[tuple[str, Optional[int]], torch.Tensor]:
    """{(name, saved EP rank or None for dense): saved tensor} over every model file (mmap'd: only what is used
    is read)."""
    manifest = read_manifest(ckpt_dir) or {"files": {}}
    out: dict[tuple[str, Optional[int]], torch.Tensor] = {}
    for rel in sorted(manifest["files"]):
        if rel.startswith("model/"):
            m = _EXPERT_FILE.search(rel)
            for name, t in load_file(ckpt_dir, rel).items():
                out[(name, int(m.group(1)) if m else None)] = t
    return out


def _local_slice(slices_by_ep: dict[Optional[int], torch.Tensor], ep_rank: int, ep_size: int) -> torch.Tensor:
    """This EP rank's part of a parameter (flat or shaped) from its saved slices (one per saved EP rank)."""
    if None in slices_by_ep:
        return slices_by_ep[None]
    full = torch.cat([slices_by_ep[e] for e in sorted(slices_by_ep)])
    n = full.shape[0] // ep_size
    return full[ep_rank * n : (ep_rank + 1) * n]


def load_model(ckpt_dir: Path, model: nn.Module, ep_rank: int, ep_size: int) -> None:
    saved = _saved_model_tensors(Path(ckpt_dir))
    by_name: dict[str, dict[Optional[int], torch.Tensor]] = {}
    for (name, e), t in saved.items():
        by_name.setdefault(name, {})[e] = t
    want = model.state_dict()
    missing = sorted(set(want) - set(by_name))
    if missing:
        raise CheckpointError(f"{ckpt_dir}: parameters {missing[:4]} are in no model file; use the same model.* "
                              "config as the run that wrote it")
    model.load_state_dict({k: _local_slice(by_name[k], ep_rank, ep_size) for k in want}, strict=True)


def load_optimizer(ckpt_dir: Path, opt: Any, saved_layout: dict[str, Any]) -> None:
    """Fill `opt` (this rank's ShardedAdamW, built for the current layout) from a checkpoint of any layout."""
    ckpt_dir = Path(ckpt_dir)
    numel = {key: t.numel() for key, t in _saved_model_tensors(ckpt_dir).items()}
    need = {n for b in opt.buckets for n in b.param_names}
    found: dict[str, dict[Optional[int], dict[str, torch.Tensor]]] = {}
    covered: dict[tuple[str, Optional[int]], int] = {}
    step = None
    n_saved = saved_layout["dp"] * saved_layout["ep"] * saved_layout.get("pp", 1)
    files = {layout.optimizer_file(saved_rank_coords(r, saved_layout)): saved_rank_coords(r, saved_layout)
             for r in range(n_saved)}  # with optimizer_sharding=none, DP replicas share one file: read it once
    for rel, c in files.items():
        sd = load_file(ckpt_dir, rel)
        step = int(sd["step"])
        for bucket_name, s in sd["buckets"].items():
            e = c.ep_rank if bucket_name.startswith("expert.") else None
            width = -(-s["numel"] // s["shard_count"])
            lo = s["shard_index"] * width
            hi = min(lo + width, s["numel"])
            off = 0
            for name in s["param_names"]:
                n = numel[(name, e)]
                a, b = max(lo, off), min(hi, off + n)
                if a < b and name in need:
                    slot = found.setdefault(name, {}).setdefault(e, {})
                    for k in STATE_KEYS:
                        flat_N = slot.setdefault(k, torch.zeros(n, dtype=torch.float32))
                        flat_N[a - off : b - off] = s[k][a - lo : b - lo]
                    if (name, e, lo) not in covered:  # an EP-replicated dense shard comes once per EP rank
                        covered[(name, e, lo)] = b - a
                off += n
    _fill(opt, found, covered, numel, ckpt_dir)
    opt.step_count = step


def _fill(opt: Any, found: dict, covered: dict, numel: dict, ckpt_dir: Path) -> None:
    g = opt.groups
    for bucket in opt.buckets:
        lo, hi = bucket.shard_lo, min(bucket.shard_lo + bucket.shard_len, bucket.numel)
        fresh = {k: torch.zeros(bucket.shard_len, dtype=torch.float32, device=bucket.exp_avg.device)
                 for k in STATE_KEYS}  # padding stays zero
        name_of = {id(p): n for p, n in zip(bucket.params, bucket.param_names)}
        for p, a, off, n in bucket.param_pieces(lo, hi) if hi > lo else ():
            name = name_of[id(p)]
            saved = found.get(name)
            done = sum(v for (k, e, _), v in covered.items() if k == name)
            if saved is None or done != sum(v for (k, e), v in numel.items() if k == name and e in saved):
                raise CheckpointError(f"{ckpt_dir}: the optimizer state of {name} is incomplete in the saved files; "
                                      "resume with the layout that wrote it or from a model-only checkpoint")
            for k in STATE_KEYS:
                local = _local_slice({e: t[k] for e, t in saved.items()}, g.ep_rank, g.ep_size)
                fresh[k][off : off + n] = local[a : a + n].to(fresh[k].device)
        bucket.adopt_param_storage()
        for k in STATE_KEYS:
            setattr(bucket, k, fresh[k])
