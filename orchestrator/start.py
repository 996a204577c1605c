"""Starting a run in its directory: the login side's step between the plan and the follow loop.

`start_run` holds the run directory's start lock (runlock.py) while it checks that no allocation of this run is
alive, tidies what an earlier start of the same run left behind (its STOP request, its summary), marks the start in
the journal (the supervisor then re-checks nodes that only failed a check, and keeps those that failed hard), writes
config.yaml and starts the allocation. Run again under the same name, a stopped or failed run resumes from its
checkpoints. `earlier_exclusions` names the hard failures of earlier starts, which the first allocation of the new
start already excludes (`--exclude`).
"""

from __future__ import annotations

from moe_launch.conf.load import dump_config
from moe_launch.conf.schema import RootConfig
from moe_launch.errors import SubmissionError
from moe_launch.orchestrator import login
from moe_launch.orchestrator.plan import LaunchPlan
from moe_launch.orchestrator.runlock import RunLock, live_allocation, refusal, squeue_all
from moe_launch.orchestrator.state import NEW_START, carried_exclusions, replay
from moe_launch.orchestrator.supervisor import STOP_FILE
from moe_launch.rundir import RunDir, journal_event, read_jsonl


def earlier_exclusions(cfg: RootConfig, rd: RunDir) -> dict[str, str]:
    """Nodes that failed hard in earlier starts of this run (node -> why); empty for a new run."""
    records = read_jsonl(rd.journal)
    state = replay(records, cfg.cluster.nodes, cfg.supervisor.max_restarts)
    excluded = carried_exclusions(state.excluded, new_start=True) if state else {}
    for r in records:  # the supervisor's own node, lost: only the login side saw it
        if r.get("kind") == "failure" and r.get("details", {}).get("supervisor_lost"):
            excluded.update({n: "the supervisor's node was lost" for n in r["nodes"]})
    return excluded


def start_run(cfg: RootConfig, rd: RunDir, p: LaunchPlan) -> str:
    """Start the allocation; returns its handle. SubmissionError when this run is already running (naming the
    `attach` command) or the scheduler refused."""
    with RunLock(rd.root):
        live = live_allocation(rd.root, p.kind, login.handles(read_jsonl(rd.journal)), login.handle_alive,
                               squeue_all if p.kind == "slurm" else None)
        if live:
            raise SubmissionError(refusal(rd.root, live))
        records = read_jsonl(rd.journal)
        if records:
            journal_event(rd, "info", (), message="moe-launch started again under this run name", **{NEW_START: True})
        if (rd.root / STOP_FILE).exists():  # asked of an earlier start, which has ended
            (rd.root / STOP_FILE).unlink()
            journal_event(rd, "info", (), message="cleared the stop request left by an earlier start")
        if rd.summary.exists():  # started again under its name: keep the old outcome, resume its checkpoints
            kept = rd.root / f"summary-{len(list(rd.root.glob('summary-*.json')))}.json"
            rd.summary.rename(kept)
            journal_event(rd, "info", (), message=f"started again; the previous outcome is kept in {kept.name}")
        dump_config(cfg, rd.config)
        return login.submit(cfg, rd, p)
