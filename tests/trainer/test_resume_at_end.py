"""A run whose newest checkpoint is its last step (the time-limit warning arrived during the final step) resumes to
a clean end: every rank exits EXIT_OK without training or writing, and a signal during the final step is no
preemption (the run is complete)."""

from trainer_harness import launch_ranks, tiny_cfg, write_run

from moe_launch.rundir import EXIT_OK, read_jsonl


def test_resume_at_the_final_step_ends_cleanly_on_every_rank(tmp_path, data_cache):
    rd = write_run(tmp_path / "run", tiny_cfg(data_cache, dp=2, steps=4))
    procs = launch_ranks(rd, world=2)
    assert [p.returncode for p in procs] == [EXIT_OK] * 2, [p.stdout[-2000:] for p in procs]
    before = sorted((p.name, p.stat().st_mtime_ns) for p in rd.checkpoints.iterdir())
    procs = launch_ranks(rd, world=2, attempt=1)
    assert [p.returncode for p in procs] == [EXIT_OK] * 2, [p.stdout[-2000:] for p in procs]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in rd.checkpoints.iterdir()) == before
    resumes = [e for e in read_jsonl(rd.journal) if e["kind"] == "resume"]
    assert resumes and resumes[-1]["details"]["step"] == 4


def test_a_stop_signal_during_the_final_step_is_a_normal_end(tmp_path, data_cache):
    from moe_launch.trainer.loop import Trainer

    cfg = tiny_cfg(data_cache, steps=1, ckpt_interval=0)
    rd = write_run(tmp_path / "run", cfg)
    trainer = Trainer(cfg, rd)
    trainer.stop_requested = True  # as if USR2 had arrived during step 1 of 1
    assert trainer.train() == EXIT_OK
    assert not [e for e in read_jsonl(rd.journal) if e["kind"] == "stop"]
