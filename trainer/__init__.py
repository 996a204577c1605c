"""The embedded trainer: `python -m moe_launch.trainer --run-dir RUN_DIR`.

  model/       OLMo / OLMoE decoders, build_model          moe/        router, losses, MoE layer, reference
  optim/       learning-rate schedules                     parallel/   groups, sharded AdamW, EP dispatch
  checkpoint/  dual atomic checkpoints                     data/       tokenization, shards, TokenLoader
  loop.py      the Trainer                                 faults.py   NaN/Inf detection and injection
  metrics.py   metrics.jsonl, TensorBoard                  dist.py     rank detection, process group
  heartbeat.py per-rank heartbeats, off the training thread
"""
