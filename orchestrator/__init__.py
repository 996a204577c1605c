"""The orchestrator: `moe-launch` (login side) and the supervisor (inside the allocation).

  cli.py         the Hydra app and the attach/status/stop/report subcommands
  plan.py        pure plan(cfg, partition, quarantined) -> LaunchPlan; impossible requests fail here
  render.py      pure render_sbatch(plan) -> the job script (every value shell-quoted)
  login.py       submit, follow, resubmit a dead allocation excluding bad nodes, stop
  live.py        the live view, rebuilt from the run directory alone
  supervisor.py  observe -> event -> decide() -> journal -> act, inside the allocation
  events.py      what the supervisor observes          decide.py   pure decide(state, event) -> Action
  state.py       supervisor state, apply(), replay of journal.jsonl
  watch.py       heartbeats and fault records -> events
  backend.py     the cluster/step interface            local_cluster.py, slurm.py  its two implementations
  srun.py        the one builder of srun command lines (trainer steps, node probes, health tasks)
  summary.py     summary.json                          report.py   plots of runs (moe-launch report)
  sweep.py       multirun sweeps: one supervised run per combination, the sweep table and sweep_summary.json
"""
