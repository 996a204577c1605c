"""`model.init_from=hf:/path` through the real trainer (two ranks, EP=2), then export of what it saved.

With a negligible learning rate the model checkpoint the trainer writes after two steps must still hold the HF
weights, so this checks the trainer's wiring of load_hf_into_model (EP slicing, DP broadcast) end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from helpers_net import free_port
from hf_helpers import random_token_dataset, rel_err, tiny_olmoe

from moe_launch.conf.load import dump_config
from moe_launch.conf.schema import ClusterConfig, DataConfig, ParallelConfig, RootConfig, TrainConfig
from moe_launch.rundir import RunDir, read_jsonl
from moe_launch.trainer.interop.gather import full_state_from_checkpoint
from moe_launch.trainer.interop.hf import export_hf, hf_state_for_rank
from moe_launch.trainer.interop.hf_config import model_config_from_hf, read_hf_config

REPO = Path(__file__).resolve().parents[2]


def test_trainer_starts_from_hf_and_exports_back(tmp_path):
    from transformers import OlmoeForCausalLM

    torch.set_num_threads(1)
    hf_model = tiny_olmoe(num_experts=4, top_k=2, n_layers=2, vocab=512)
    hf_model.save_pretrained(tmp_path / "hf")
    model_cfg = model_config_from_hf(read_hf_config(tmp_path / "hf"))
    model_cfg.init_from = f"hf:{tmp_path / 'hf'}"
    cfg = RootConfig(
        model=model_cfg, parallel=ParallelConfig(dp=1, ep=2),
        train=TrainConfig(steps=2, global_batch_size=4, micro_batch_size=2, seq_len=32, lr=1e-12, min_lr=0.0,
                          warmup_steps=0, weight_decay=0.0, ckpt_interval=0, model_ckpt_interval=2, progress=False),
        data=DataConfig(path=random_token_dataset(tmp_path / "data", seq_len=32, vocab=512)),
        cluster=ClusterConfig(kind="local", nodes=2, tasks_per_node=1),
    )
    rd = RunDir(tmp_path / "run").make()
    dump_config(cfg, rd.config)
    port, procs = free_port(), []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), MOE_LAUNCH_NODE=f"node{r}", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "moe_launch.trainer", "--run-dir", str(rd.root)],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-1500:] for o in outs)
    assert any(e["kind"] == "resume" and str(e["details"].get("checkpoint", "")).startswith("hf:")
               for e in read_jsonl(rd.journal))

    state, saved_cfg = full_state_from_checkpoint(rd.checkpoints / "model-step-2")
    want = hf_state_for_rank(tmp_path / "hf", model_cfg)
    for k in want:
        assert torch.allclose(state[k], want[k], rtol=0, atol=1e-7), k
    export_hf(state, saved_cfg, tmp_path / "out")
    back = OlmoeForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(back(tokens).logits, hf_model(tokens).logits) <= 1e-5
