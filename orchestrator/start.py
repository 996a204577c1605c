"""Starting a run in its directory: the login side's step between the plan and the follow loop.

`start_run` holds the run directory's start lock (runlock.py) while it checks that no allocation of this run is
alive, tidies what an earlier start of the same run left behind, writes config.yaml and starts the allocation. Run
again under the same name, a stopped or failed run resumes from its checkpoints.
"""

from __future__ import annotations

from moe_launch.conf.load import dump_config
from moe_launch.conf.schema import RootConfig
from moe_launch.errors import SubmissionError
from moe_launch.orchestrator import login
from moe_launch.orchestrator.plan import LaunchPlan
from moe_launch.orchestrator.runlock import RunLock, live_allocation, refusal, squeue_all
from moe_launch.rundir import RunDir, journal_event, read_jsonl


def start_run(cfg: RootConfig, rd: RunDir, p: LaunchPlan) -> str:
    """Start the allocation; returns its handle. SubmissionError when this run is already running (naming the
    `attach` command) or the scheduler refused."""
    with RunLock(rd.root):
        live = live_allocation(rd.root, p.kind, login.handles(read_jsonl(rd.journal)), login.handle_alive,
                               squeue_all if p.kind == "slurm" else None)
        if live:
            raise SubmissionError(refusal(rd.root, live))
        if rd.summary.exists():  # started again under its name: keep the old outcome, resume its checkpoints
            kept = rd.root / f"summary-{len(list(rd.root.glob('summary-*.json')))}.json"
            rd.summary.rename(kept)
            journal_event(rd, "info", (), message=f"started again; the previous outcome is kept in {kept.name}")
        dump_config(cfg, rd.config)
        return login.submit(cfg, rd, p)
