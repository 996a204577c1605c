"""`python -m moe_launch.trainer.interop COMMAND`: conversions between our checkpoints and the HF OLMoE format.

  export   CKPT_DIR OUT_DIR [--dtype bf16]     checkpoint of any DP x EP layout -> HF dir (config.json + safetensors)
  import   HF_DIR OUT_DIR [--ep N]             HF dir -> model-only checkpoint; train with model.init_from=ckpt:OUT_DIR
  upcycle  DENSE_CKPT OUT_DIR --experts E --top-k K [--ep N] [--norm-topk-prob] [--router-std S]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional

import torch

from moe_launch.errors import MoeLaunchError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m moe_launch.trainer.interop", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="checkpoint -> HF OLMoE directory")
    ex.add_argument("ckpt")
    ex.add_argument("out")
    ex.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast on write (default: as stored)")
    im = sub.add_parser("import", help="HF OLMoE directory -> model-only checkpoint")
    im.add_argument("hf")
    im.add_argument("out")
    im.add_argument("--ep", type=int, default=1, help="parallel.ep of the run that will load it")
    up = sub.add_parser("upcycle", help="dense checkpoint -> MoE model-only checkpoint")
    up.add_argument("dense_ckpt")
    up.add_argument("out")
    up.add_argument("--experts", type=int, required=True)
    up.add_argument("--top-k", type=int, required=True)
    up.add_argument("--norm-topk-prob", action="store_true")
    up.add_argument("--ep", type=int, default=1)
    up.add_argument("--router-std", type=float, default=0.0)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from moe_launch.trainer.interop.gather import full_state_from_checkpoint, write_model_checkpoint
    from moe_launch.trainer.interop.hf import export_hf, hf_state_for_rank
    from moe_launch.trainer.interop.hf_config import model_config_from_hf, read_hf_config
    from moe_launch.trainer.interop.upcycle import upcycle_checkpoint

    try:
        if args.cmd == "export":
            state, cfg = full_state_from_checkpoint(args.ckpt)
            if cfg is None:
                raise MoeLaunchError(f"{args.ckpt} records no model config; export from a trainer-written checkpoint")
            out = export_hf(state, cfg, args.out, dtype=DTYPES.get(args.dtype))
        elif args.cmd == "import":
            cfg = model_config_from_hf(read_hf_config(args.hf))
            out = write_model_checkpoint(hf_state_for_rank(args.hf, cfg), cfg, args.out, ep_size=args.ep)
            print(f"model config: {dataclasses.asdict(cfg)}")
        else:
            _, dense_cfg = full_state_from_checkpoint(args.dense_ckpt)
            if dense_cfg is None or dense_cfg.kind != "dense":
                raise MoeLaunchError(f"{args.dense_ckpt} is not a checkpoint of a kind=dense run")
            moe = dataclasses.replace(dense_cfg.moe, num_experts=args.experts, top_k=args.top_k,
                                      expert_hidden=dense_cfg.ffn_hidden, norm_topk_prob=args.norm_topk_prob)
            cfg = dataclasses.replace(dense_cfg, kind="moe", moe=moe)
            out = upcycle_checkpoint(args.dense_ckpt, cfg, args.out, ep_size=args.ep, router_std=args.router_std)
    except MoeLaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
