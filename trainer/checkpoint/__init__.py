"""Dual alternating checkpoints (ckpt-a / ckpt-b), persistent model-only checkpoints (model-step-N).

  store.py   atomic multi-rank directory writes with a sha256 manifest written last; verify; choose the slot
  layout.py  which rank writes / reads which file (DP-scattered writes, EP-sharded experts)
  state.py   the objects in those files (model parts, optimizer shard, RNG states, trainer state)
"""
