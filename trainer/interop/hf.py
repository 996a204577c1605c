"""Import and export of OLMoE-format HF checkpoints (safetensors + config.json), EP-aware.

Name map (layer i; E global experts, F expert hidden, D model dim):
  ours                                  HF (OlmoeForCausalLM)
  embed.weight                          model.embed_tokens.weight
  blocks.i.attn_norm.weight             model.layers.i.input_layernorm.weight
  blocks.i.attn.{q,k,v,o}_proj.weight   model.layers.i.self_attn.{q,k,v,o}_proj.weight
  blocks.i.attn.{q,k}_norm.weight       model.layers.i.self_attn.{q,k}_norm.weight
  blocks.i.ffn_norm.weight              model.layers.i.post_attention_layernorm.weight  (a pre-MLP norm in OLMoE)
  blocks.i.ffn.router.weight [E,D]      model.layers.i.mlp.gate.weight
  blocks.i.ffn.w_gate_EFD[e]            model.layers.i.mlp.experts.e.gate_proj.weight [F,D]
  blocks.i.ffn.w_up_EFD[e]              model.layers.i.mlp.experts.e.up_proj.weight   [F,D]
  blocks.i.ffn.w_down_EDF[e]            model.layers.i.mlp.experts.e.down_proj.weight [D,F]
  norm.weight, lm_head.weight           model.norm.weight, lm_head.weight
A dense model (kind=dense) is the one-expert, top-1 OLMoE (hf_config.py explains why that is exact): its
blocks.i.ffn.{gate,up,down}_proj.weight are expert 0, and the router is a zero [1, D] matrix.

On disk, the Hub checkpoints and transformers' save_pretrained (4.x and 5.x) store one tensor per expert as above.
In memory transformers 5 fuses them (OlmoeExperts.gate_up_proj [E, 2F, D] = gate rows then up rows, down_proj
[E, D, F]); files written in that fused form are read too. Export writes the per-expert form.

Import reads only this EP rank's experts (safetensors slices are lazy), so no rank holds the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn

from moe_launch.conf.schema import ModelConfig
from moe_launch.errors import CheckpointError
from moe_launch.trainer.interop.hf_config import check_compatible, hf_config_from_model, read_hf_config

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_EXPERT = {"w_gate_EFD": "gate_proj", "w_up_EFD": "up_proj", "w_down_EDF": "down_proj"}
DEFAULT_SHARD_BYTES = 4 << 30


def hf_path(spec: str | Path) -> Path:
    return Path(str(spec).removeprefix("hf:")).expanduser()


class SafetensorsDir:
    """Lazy reader of a save_pretrained directory: model.safetensors, or the shards model.safetensors.index.json
    lists."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{path} holds no model.safetensors or model.safetensors.index.json; "
                                  "save the HF model with save_pretrained(..., safe_serialization=True)")
        self._files = {}
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for name in files:
            self._files[name] = safe_open(str(path / name), framework="pt")
        self._where = weight_map or {k: "model.safetensors" for k in self._files["model.safetensors"].keys()}
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str, rows: Optional[slice] = None) -> torch.Tensor:
        """The tensor `key`, or only rows [rows] of its first dimension (read lazily)."""
        if key not in self._where:
            raise CheckpointError(f"{self.path}: tensor {key} is missing; the checkpoint is incomplete or not in the "
                                  "OLMoE format")
        handle = self._files[self._where[key]]
        return handle.get_slice(key)[rows] if rows is not None else handle.get_tensor(key)


def _layer(i: int) -> str:
    return f"model.layers.{i}"


def _expert_slice(reader: SafetensorsDir, i: int, first: int, count: int) -> dict[str, torch.Tensor]:
    """Experts [first, first+count) of layer i as our stacked tensors, from either on-disk expert layout."""
    prefix = f"{_layer(i)}.mlp.experts"
    if f"{prefix}.gate_up_proj" in reader:  # transformers-5 fused layout
        gate_up_E2FD = reader.get(f"{prefix}.gate_up_proj", slice(first, first + count))
        gate_EFD, up_EFD = gate_up_E2FD.chunk(2, dim=1)
        return {"w_gate_EFD": gate_EFD.contiguous(), "w_up_EFD": up_EFD.contiguous(),
                "w_down_EDF": reader.get(f"{prefix}.down_proj", slice(first, first + count))}
    return {ours: torch.stack([reader.get(f"{prefix}.{e}.{theirs}.weight") for e in range(first, first + count)])
            for ours, theirs in _EXPERT.items()}


def _shared_names(n_layers: int) -> Iterator[tuple[str, str]]:
    """(our name, HF name) of every non-FFN parameter."""
    yield "embed.weight", "model.embed_tokens.weight"
    for i in range(n_layers):
        yield f"blocks.{i}.attn_norm.weight", f"{_layer(i)}.input_layernorm.weight"
        yield f"blocks.{i}.ffn_norm.weight", f"{_layer(i)}.post_attention_layernorm.weight"
        for p in _ATTN:
            yield f"blocks.{i}.attn.{p}.weight", f"{_layer(i)}.self_attn.{p}.weight"
    yield "norm.weight", "model.norm.weight"


def hf_state_for_rank(path: str | Path, cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1
                      ) -> dict[str, torch.Tensor]:
    """Our state dict for EP rank `ep_rank` of `ep_size` (its contiguous share of the experts), read from an HF dir."""
    path = hf_path(path)
    hf = read_hf_config(path)
    check_compatible(hf, cfg)
    reader = SafetensorsDir(path)
    sd = {ours: reader.get(theirs) for ours, theirs in _shared_names(cfg.n_layers)}
    # tie_word_embeddings: the file has no lm_head; the head IS the embedding (an exact copy for our untied head)
    sd["lm_head.weight"] = reader.get("lm_head.weight") if "lm_head.weight" in reader else sd["embed.weight"].clone()
    for i in range(cfg.n_layers):
        if cfg.kind == "dense":
            for ours, w in _expert_slice(reader, i, 0, 1).items():
                sd[f"blocks.{i}.ffn.{_EXPERT[ours]}.weight"] = w[0]  # dense SwiGLU names match HF's
            continue
        e_local = cfg.moe.num_experts // ep_size
        sd[f"blocks.{i}.ffn.router.weight"] = reader.get(f"{_layer(i)}.mlp.gate.weight")
        for ours, w in _expert_slice(reader, i, ep_rank * e_local, e_local).items():
            sd[f"blocks.{i}.ffn.{ours}"] = w
    return sd


@torch.no_grad()
def load_hf_into_model(model: nn.Module, path: str | Path, ep_rank: int = 0, ep_size: int = 1) -> None:
    """Copy an OLMoE-format HF checkpoint into `model` (a trainer.model.Transformer built for ep_rank/ep_size).

    Checks config.json against model.cfg first (ConfigError naming the model.* key that differs), then loads
    strictly: every parameter must be covered. Values are cast to the model's parameter dtype.
    """
    cfg: ModelConfig = model.cfg
    if cfg.kind == "moe":
        ffn = model.blocks[0].ffn
        if ffn.e_start != ep_rank * ffn.num_local_experts or ffn.num_local_experts * ep_size != ffn.num_experts:
            raise CheckpointError(f"the model holds experts from {ffn.e_start} ({ffn.num_local_experts} local), "
                                  f"not EP rank {ep_rank}'s share of ep={ep_size}; pass the model's ep_rank/ep_size")
    sd = hf_state_for_rank(path, cfg, ep_rank, ep_size)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # OLMoE has no selection bias: a router with model.moe.balance=aux_free_bias keeps its neutral (zero) one
    missing = [k for k in missing if not k.endswith(".expert_bias_E")]
    if missing or unexpected:
        raise CheckpointError(f"{path}: parameters do not match the model (missing {missing[:4]}, unexpected "
                              f"{unexpected[:4]}); the trainer's parameter names changed, update trainer/interop/hf.py")


def hf_state_from_ours(model_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our FULL state dict (every expert: gather EP shards first, see gather.py) -> HF tensors, per-expert layout."""
    out = {theirs: model_state[ours] for ours, theirs in _shared_names(cfg.n_layers)}
    out["lm_head.weight"] = model_state["lm_head.weight"]
    for i in range(cfg.n_layers):
        prefix = f"{_layer(i)}.mlp"
        if cfg.kind == "dense":
            out[f"{prefix}.gate.weight"] = torch.zeros(1, cfg.d_model, dtype=model_state["norm.weight"].dtype)
            for theirs in _EXPERT.values():
                out[f"{prefix}.experts.0.{theirs}.weight"] = model_state[f"blocks.{i}.ffn.{theirs}.weight"]
            continue
        out[f"{prefix}.gate.weight"] = model_state[f"blocks.{i}.ffn.router.weight"]
        for ours, theirs in _EXPERT.items():
            stacked = model_state[f"blocks.{i}.ffn.{ours}"]
            if stacked.shape[0] != cfg.moe.num_experts:
                raise CheckpointError(f"blocks.{i}.ffn.{ours} holds {stacked.shape[0]} experts, the model has "
                                      f"{cfg.moe.num_experts}: gather the EP shards before exporting (gather.py)")
            for e in range(cfg.moe.num_experts):
                out[f"{prefix}.experts.{e}.{theirs}.weight"] = stacked[e]
    return out


def export_hf(model_state: dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str | Path,
              dtype: Optional[torch.dtype] = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write config.json + model.safetensors (or shards + index) that OlmoeForCausalLM.from_pretrained reads.

    `model_state`: our full state dict (all experts). `dtype`: cast on write (None: the model's own dtype).
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    views = hf_state_from_ours(model_state, model_cfg)  # per-expert views share storage with the stacked tensors
    out_dtype = dtype or views["model.norm.weight"].dtype
    itemsize = torch.empty((), dtype=out_dtype).element_size()
    plan: list[list[str]] = [[]]
    size = 0
    for key in sorted(views):
        nbytes = views[key].numel() * itemsize
        if plan[-1] and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(key)
        size += nbytes
    names = ["model.safetensors"] if len(plan) == 1 else \
        [f"model-{n:05d}-of-{len(plan):05d}.safetensors" for n in range(1, len(plan) + 1)]
    for name, keys in zip(names, plan):
        # materialise one shard at a time: a 7B export never holds a second copy of the whole model
        shard = {k: views[k].detach().to("cpu", out_dtype).contiguous().clone() for k in keys}
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        del shard
    if len(plan) > 1:
        weight_map = {k: name for name, keys in zip(names, plan) for k in keys}
        total = sum(views[k].numel() * itemsize for k in views)
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = hf_config_from_model(model_cfg)
    config["torch_dtype"] = config["dtype"] = str(out_dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
