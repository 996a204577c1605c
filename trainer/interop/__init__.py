"""HF OLMoE import/export and dense -> MoE upcycling.

  hf_config.py  config.json <-> ModelConfig, and which HF architectures match ours exactly
  hf.py         weights: load_hf_into_model (EP-sliced), export_hf (safetensors + config.json)
  gather.py     full state from EP-sharded checkpoints or a live EP group; write a model-only checkpoint
  upcycle.py    dense -> MoE (every expert a copy of the dense FFN)
  __main__.py   `python -m moe_launch.trainer.interop export|import|upcycle`
"""
