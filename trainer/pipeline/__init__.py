"""Pipeline parallelism: stages from the layer list, GPipe / 1F1B / interleaved 1F1B schedules, p2p runtime.

    schedule.py  pure per-stage action orders and a simulator (dependencies, bubbles)
    plan.py      pure per-stage programs: compute actions + matched point-to-point rounds
    split.py     which layers go to which chunk (given, or balanced by parameter count)
    stage.py     StageModel: the modules of one stage, named as in the full model
    p2p.py       one round of batched isend / irecv
    runtime.py   build_pipeline / pipeline_step: the entry points the trainer calls
(Checkpoint files name the stage: trainer/checkpoint/layout.py.)
"""

from moe_launch.trainer.pipeline.runtime import Pipeline, build_pipeline, pipeline_step

__all__ = ["Pipeline", "build_pipeline", "pipeline_step"]
