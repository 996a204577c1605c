"""`moe-launch report`: plots and report.html from metrics.jsonl and the journal, on a synthetic dense-vs-MoE sweep
(with a restart, a failure and a node swap) and a real short trainer run; the page checked in headless Chromium."""

from __future__ import annotations

import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from interop.hf_helpers import random_token_dataset

from moe_launch.conf.load import dump_config
from moe_launch.conf.schema import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RootConfig,
    TrainConfig,
)
from moe_launch.orchestrator.report import (
    Event,
    RunSeries,
    journal_events,
    last_per_step,
    legend_labels,
    load_matrix,
    main_report,
    make_plots,
    read_run,
    step_times,
)
from moe_launch.rundir import RunDir, append_jsonl

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_valid_png(path: Path, min_colours: int = 8) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        w, h = im.size
        assert w >= 300 and h >= 200, (path, im.size)
        rgb = np.asarray(im.convert("RGB")).reshape(-1, 3).astype(np.uint32)
    packed = (rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2]  # one integer per colour: 1-D unique is fast
    colours, counts = np.unique(packed, return_counts=True)
    assert len(colours) >= min_colours, f"{path}: only {len(colours)} colours (blank plot?)"
    # not a blank canvas: a visible share of pixels differs from the dominant (background) colour
    assert counts.max() / len(packed) < 0.98, f"{path}: almost all one colour"


def _cfg(kind: str) -> RootConfig:
    model = ModelConfig(kind=kind, vocab_size=512, d_model=32, n_layers=2, n_heads=4, max_seq_len=128,
                        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=32))
    return RootConfig(model=model)


def _synthetic_run(root: Path, kind: str, seed: int, steps: int = 40, restart_at: int = 0,
                   overrides: tuple[str, ...] = ()) -> RunDir:
    """Loss decaying like a real run, noisy step times, per-layer expert counts with a persistently hot expert,
    and (restart_at) a failure, a node swap and a relaunch that re-logs the steps after the last checkpoint after a
    long gap; `overrides` as Hydra records them."""
    rd = RunDir(root).make()
    dump_config(_cfg(kind), rd.config)
    if overrides:
        (rd.root / ".hydra").mkdir()
        (rd.root / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in (*overrides, "run.name=x")))
    rng = random.Random(seed)
    t = 1.7e9
    plan = list(range(1, steps + 1))
    if restart_at:
        plan = plan[:restart_at] + list(range(restart_at - 3, steps + 1))
    for i, step in enumerate(plan):
        t += 0.2 + 0.02 * rng.random() + (90.0 if restart_at and i == restart_at else 0.0)
        rec = {"step": step, "lm_loss": 6.2 * math.exp(-step / 25) + 3.0 + 0.05 * rng.random(), "grad_norm":
               2.0 * math.exp(-step / 10) + 0.4 + 0.1 * rng.random(), "lr": 1e-3 * min(1.0, step / 5),
               "tokens_per_s": 5000.0 + 100 * rng.random(), "mfu": 0.4 + 0.01 * rng.random(), "time": t}
        rec["loss"] = rec["lm_loss"]
        if kind == "moe":
            counts = [[rng.randint(20, 40) + (60 if e == layer + 1 else 0) for e in range(8)] for layer in range(2)]
            ratios = [max(c) / (sum(c) / len(c)) for c in counts]
            rec.update(aux_loss=0.011, z_loss=0.003, expert_counts=counts, expert_load_max=max(ratios),
                       expert_load_mean=sum(ratios) / 2)
        append_jsonl(rd.metrics, rec)
        if step % 10 == 0:
            append_jsonl(rd.journal, {"time": t, "kind": "checkpoint", "nodes": [], "details": {"step": step,
                                                                                               "slot": "ckpt-a"}})
        if restart_at and i == restart_at - 1:
            for kind_, details in (("failure", {"reason": "node_failure"}), ("swap", {"out": "n2", "in": "n9"}),
                                   ("resume", {"step": restart_at - 4, "attempt": 1})):
                append_jsonl(rd.journal, {"time": t + 1, "kind": kind_, "nodes": ["n2"], "details": details})
    return rd


def test_synthetic_dense_vs_moe(tmp_path):
    dense = _synthetic_run(tmp_path / "dense", "dense", seed=1, overrides=("model=tiny_dense", "train.lr=1e-3"))
    moe = _synthetic_run(tmp_path / "moe", "moe", seed=2, restart_at=20, overrides=("model=tiny_moe", "train.lr=1e-3"))
    paths = make_plots([dense.root, moe.root], out_dir=tmp_path / "sweep_plots")
    assert sorted(p.name for p in paths) == ["expert_balance.png", "expert_load.png", "grad_norm.png", "loss.png",
                                             "lr.png", "mfu.png", "report.html", "step_time.png", "timeline.png",
                                             "tokens_per_s.png"]
    for p in paths:
        if p.suffix == ".png":
            assert_valid_png(p)
    page = (tmp_path / "sweep_plots" / "report.html").read_text()
    assert "model=tiny_moe" in page and "model=tiny_dense" in page  # legends name the swept value, not the dir
    assert "node swap: n2 -&gt; n9" in page and page.count("<figure") == 9
    assert '<table id="goodput">' in page and "productive" in page  # goodput.py's account, per run

    s = read_run(moe.root)
    assert s.kind == "moe" and s.name == "moe"
    assert list(s.steps) == list(range(1, 41))  # the re-logged steps 17..20 appear once
    assert np.isnan(s.step_time[0]) and np.nanmax(s.step_time) < 1.0  # the 90 s relaunch gap is not a step
    assert s.load_LE.shape == (2, 8) and s.load_SLE.shape == (40, 2, 8)
    kinds = [e.kind for e in s.events]
    assert kinds.count("checkpoint") == 5 and {"failure", "swap", "restart"} <= set(kinds)
    assert next(e for e in s.events if e.kind == "restart").step == 16
    hot = s.load_LE.argmax(axis=1)
    assert list(hot) == [1, 2]
    assert np.allclose(s.load_LE.mean(axis=1), 1.0)


def test_held_out_loss_is_read_and_drawn_on_the_loss_panel(tmp_path):
    from moe_launch.orchestrator.report_plots import loss_figure

    rd = _synthetic_run(tmp_path / "run", "moe", seed=4, steps=20)
    before = loss_figure([read_run(rd.root)], tmp_path / "without.png").read_bytes()
    for step, loss in ((10, 4.6), (20, 4.1), (20, 4.0)):  # a resumed run re-evaluates a step: the last one counts
        append_jsonl(rd.evals, {"step": step, "eval_lm_loss": loss, "eval_sequences": 8, "eval_s": 0.1})
    s = read_run(rd.root)
    assert s.heldout.tolist() == [[10.0, 4.6], [20.0, 4.0]]
    after = loss_figure([s], tmp_path / "with.png")
    assert_valid_png(after)
    assert after.read_bytes() != before
    assert read_run(_synthetic_run(tmp_path / "plain", "dense", seed=5, steps=5).root).heldout.shape == (0, 2)


def test_single_run_report_and_cli(tmp_path, capsys):
    rd = _synthetic_run(tmp_path / "run", "moe", seed=3, steps=12)
    assert main_report(rd.root) == 0
    printed = capsys.readouterr().out.split()
    assert {Path(p).name for p in printed} >= {"loss.png", "expert_load.png", "step_time.png", "report.html"}
    assert all(Path(p).parent == rd.root / "plots" for p in printed)
    empty = RunDir(tmp_path / "empty").make()
    assert main_report(empty.root) == 1
    assert make_plots(empty.root) == []


def test_a_sweep_directory_overlays_its_runs(tmp_path):
    _synthetic_run(tmp_path / "sweep" / "s-0", "moe", seed=1, steps=6, overrides=("train.lr=1e-3",))
    _synthetic_run(tmp_path / "sweep" / "s-1", "moe", seed=2, steps=6, overrides=("train.lr=3e-4",))
    proc = subprocess.run([str(Path(sys.executable).with_name("moe-launch")), "report", str(tmp_path / "sweep")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "sweep" / "plots" / "report.html").read_text()
    assert "<td>train.lr=1e-3</td>" in page and "<td>train.lr=3e-4</td>" in page


def test_report_without_matplotlib_says_what_to_install(tmp_path):
    rd = _synthetic_run(tmp_path / "run", "moe", seed=3, steps=4)
    code = ("import sys; sys.modules['matplotlib'] = None\n"  # import matplotlib now raises ImportError
            "from moe_launch.orchestrator.cli import main\n"
            f"main(['report', {str(rd.root)!r}])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "pip install matplotlib" in proc.stderr and "Traceback" not in proc.stderr


def test_pure_readers():
    recs = [{"step": 1, "loss": 3.0, "time": 10.0}, {"step": 2, "loss": 2.0, "time": 11.0},
            {"step": 2, "loss": 1.5, "time": 50.0}, {"step": 4, "loss": 1.0, "time": 52.0}]
    kept = last_per_step(recs)
    assert [r["loss"] for r in kept] == [3.0, 1.5, 1.0]
    dt = step_times(kept)
    assert np.isnan(dt[0]) and dt[1] == pytest.approx(40.0) and dt[2] == pytest.approx(1.0)
    assert list(step_times([{"step": 1, "step_time_s": 0.5}, {"step": 2}])[:1]) == [0.5]
    assert load_matrix([{"step": 1}]) is None
    m = load_matrix([{"expert_counts": [[1, 3], [2, 2]]}, {"expert_counts": [[3, 1], [0, 0]]}])
    assert np.allclose(m, [[1.0, 1.0], [0.5, 0.5]])


def test_events_land_on_the_step_axis():
    records = [{"step": 10, "time": 100.0}, {"step": 20, "time": 200.0}]
    journal = [{"time": 150.0, "kind": "failure", "nodes": ["n1"], "details": {"reason": "node_failure"}},
               {"time": 300.0, "kind": "resume", "nodes": [], "details": {"step": 12}},
               {"time": 120.0, "kind": "info", "nodes": [], "details": {}},
               {"time": 160.0, "kind": "swap", "nodes": [], "details": {"out": "n1", "in": "n5"}}]
    events = journal_events(journal, records)
    assert [(e.kind, e.step) for e in events] == [("failure", 15.0), ("swap", 16.0), ("restart", 12.0)]
    assert events[0].what == "failure: n1: node_failure" and events[1].what == "node swap: n1 -> n5"


def test_heatmap_columns_are_binned_for_long_runs():
    from moe_launch.orchestrator.report import bin_steps

    steps = np.arange(1, 1001, dtype=float)
    load = np.ones((1000, 2, 4))
    load[:500, 0, 0] = 3.0
    s2, l2 = bin_steps(steps, load, max_bins=10)
    assert s2.shape == (10,) and l2.shape == (10, 2, 4)
    assert s2[0] == pytest.approx(50.5) and l2[0, 0, 0] == 3.0 and l2[-1, 0, 0] == 1.0
    same_s, same_l = bin_steps(steps[:5], load[:5])
    assert np.array_equal(same_s, steps[:5]) and same_l.shape == (5, 2, 4)  # short runs keep every step


def test_a_constant_series_gets_a_zero_based_axis():
    from matplotlib.figure import Figure

    from moe_launch.orchestrator.report_plots import unflatten

    ax = Figure().add_subplot()
    ax.plot([1, 2, 3], [0.011, 0.011, 0.011])
    unflatten(ax)
    assert ax.get_ylim() == (0.0, pytest.approx(0.01375))
    ax2 = Figure().add_subplot()
    ax2.plot([1, 2], [1.0, 2.0])
    before = ax2.get_ylim()
    unflatten(ax2)
    assert ax2.get_ylim() == before  # a varying series keeps matplotlib's limits


def test_legends_name_what_differs():
    def run(name, *overrides):
        return RunSeries(name=name, kind="moe", overrides=list(overrides))

    a, b = run("sw-0", "train.lr=1e-3", "model=tiny_moe"), run("sw-1", "train.lr=3e-4", "model=tiny_moe")
    assert legend_labels([a, b]) == ["train.lr=1e-3", "train.lr=3e-4"]
    assert legend_labels([a]) == ["sw-0"]
    assert legend_labels([run("x"), run("y")]) == ["x", "y"]
    assert legend_labels([run("x", "a=1"), run("y", "a=1")]) == ["x", "y"]  # a rerun: the names tell them apart
    assert Event(1.0, 2.0, "swap", "s").kind == "swap"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian package `chromium` (apt-get install chromium)")
def test_report_page_in_headless_chromium(tmp_path):
    """The page as a browser sees it: the DOM has the runs, figures and events; the screenshot is not blank."""
    moe = _synthetic_run(tmp_path / "moe", "moe", seed=2, restart_at=20, overrides=("train.lr=1e-3",))
    dense = _synthetic_run(tmp_path / "dense", "dense", seed=1, overrides=("train.lr=3e-4",))
    assert main_report(moe.root, [dense.root]) == 0
    page = moe.root / "plots" / "report.html"
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(common + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert '<table id="runs">' in dom.stdout and "<td>train.lr=1e-3</td>" in dom.stdout
    for fig in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time", "expert_load", "expert_balance",
                "timeline"):
        assert f'id="fig-{fig}"' in dom.stdout, fig
    assert 'class="swap"' in dom.stdout and 'class="restart"' in dom.stdout
    shot = tmp_path / "report.png"
    snap = subprocess.run(common + [f"--screenshot={shot}", "--window-size=1200,2400", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert snap.returncode == 0, snap.stderr[-2000:]
    assert_valid_png(shot, min_colours=50)  # rendered text and plots, not an empty or error page


def test_plots_from_a_real_trainer_run(tmp_path):
    """Four steps of the real trainer (one CPU rank), then the report on what it logged."""
    cfg = RootConfig(
        model=ModelConfig(kind="moe", vocab_size=512, d_model=32, n_layers=2, n_heads=4, max_seq_len=32,
                          moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32)),
        parallel=ParallelConfig(dp=1),
        train=TrainConfig(steps=4, global_batch_size=4, micro_batch_size=2, seq_len=32, warmup_steps=1,
                          ckpt_interval=0, progress=False, tracking=[]),
        data=DataConfig(path=random_token_dataset(tmp_path / "data", seq_len=32, vocab=512)),
        cluster=ClusterConfig(kind="local", nodes=1, tasks_per_node=1),
    )
    rd = RunDir(tmp_path / "real").make()
    dump_config(cfg, rd.config)
    env = dict(os.environ, OMP_NUM_THREADS="1", MOE_LAUNCH_NODE="node0")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "moe_launch.trainer", "--run-dir", str(rd.root)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    paths = make_plots(rd.root)
    names = {p.name for p in paths}
    assert {"loss.png", "grad_norm.png", "step_time.png", "expert_balance.png", "expert_load.png"} <= names
    for p in paths:
        if p.suffix == ".png":
            assert_valid_png(p)
    assert list(read_run(rd.root).steps) == [1, 2, 3, 4]
