"""`moe-health report` finds the history runs wrote (cluster=local runs keep theirs in the run directory), says where
it looked when there is none, writes its page under the store or the run, and draws only figures with data, with
distinct time ticks; the page is checked in headless Chromium."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from moe_launch.health import report, store
from moe_launch.health.cli import main as health_cli
from moe_launch.health.report_html import series_figure
from moe_launch.health.result import CheckResult

T0 = 1_800_000_000.0


def _local_run(runs, name, t0=T0):
    """What a cluster=local run's preflight leaves: runs/<name>/health/store/<cluster>/history.jsonl."""
    cdir = runs / name / "health" / "store" / "local"
    store.append_results(cdir, [CheckResult("local1", "compute", "pass", value=0.05, time=t0),
                                CheckResult("local2", "compute", "pass", value=0.06, time=t0),
                                CheckResult("local2", "dcgm", "unavailable", time=t0),
                                CheckResult("local1", "alltoall", "pass", value=0.2, time=t0,
                                            details={"group_nodes": ["local1", "local2"]})], name)
    return cdir


def _cli(tmp_path, *args):
    return health_cli(["report", "--cluster", "local", f"health.store_dir={tmp_path / 'empty-store'}", *args])


def test_finds_local_runs_history_and_writes_under_the_run(tmp_path, capsys):
    runs = tmp_path / "runs"
    _local_run(runs, "old", T0)
    _local_run(runs, "new", T0 + 3600)
    assert _cli(tmp_path, "--runs-root", str(runs)) == 0
    out = capsys.readouterr().out
    assert "local1" in out and "history from" in out
    page = (runs / "new" / "health" / "report.html").read_text()  # the newest run's, not the current directory
    assert "<td>local2</td>" in page and str(runs / "old") in page
    assert not (tmp_path / "report.html").exists()


def test_a_named_run_and_nothing_found(tmp_path, capsys):
    runs = tmp_path / "runs"
    _local_run(runs, "r1")
    assert _cli(tmp_path, "--run", str(runs / "r1")) == 0
    assert (runs / "r1" / "health" / "report.html").exists()
    capsys.readouterr()
    assert _cli(tmp_path, "--runs-root", str(tmp_path / "nothing")) == 1
    out = capsys.readouterr().out.replace("\n", "")
    assert "no health history found" in out and "empty-store" in out and "nothing" in out


def test_cluster_store_page_lands_in_the_store(tmp_path, capsys):
    cdir = tmp_path / "store" / "c1"
    store.append_results(cdir, [CheckResult("n1", "dcgm", "pass", time=T0)], "r")
    _local_run(tmp_path / "runs", "loc")
    args = ["report", "--cluster", "local", "cluster.name=c1", f"health.store_dir={tmp_path / 'store'}",
            "--runs-root", str(tmp_path / "runs")]
    assert health_cli(args) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert f"moe-health report --run {tmp_path / 'runs' / 'loc'}" in out  # the local run is pointed to
    page = (cdir / "report.html").read_text()
    assert "<img" not in page  # no a2a or GEMM data: no empty charts
    assert '<table id="dcgm">' in page and "all tests" in page


def test_time_ticks_are_distinct_and_rates_start_at_zero():
    points = {"n1": [(T0 + 60 * i, 700.0) for i in range(5)], "n2": [(T0 + 60 * i + 5, 700.0) for i in range(5)]}
    fig = series_figure(points, "{}", "TFLOP/s", "t")
    fig.canvas.draw()
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert len(labels) >= 3 and len(set(labels)) == len(labels), labels
    assert ax.get_ylim()[0] == 0.0 and ax.get_ylim()[1] > 700.0  # a flat series is not zoomed into noise


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian package `chromium` (apt-get install chromium)")
def test_health_page_in_headless_chromium(tmp_path):
    cdir = tmp_path / "store" / "c1"
    results = []
    for day in range(3):
        t = T0 + day * 86400
        results += [CheckResult(n, "compute", "pass", value=700.0 - 30 * day * (n == "n3"), time=t)
                    for n in ("n1", "n2", "n3")]
        results.append(CheckResult("n3", "dcgm", "fail", time=t, reasons=[
            "dcgm Hardware/Memory gpu 1: fail (a very long DCGM message that must wrap, not be cut: " + "x" * 200]))
        results += [CheckResult(n, "alltoall", "pass", value=300.0 + day, time=t,
                                details={"group_nodes": ["n1", "n2", "n3"]}) for n in ("n1", "n2", "n3")]
    store.append_results(cdir, results, "r")
    page = tmp_path / "report.html"
    report.build(store.read_history(cdir), {"n3": {}}, None, "c1", page)
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(common + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for needle in ('<table id="dcgm">', '<table id="failures">', 'id="fig-gemm"', 'id="fig-bandwidth"', "x" * 200):
        assert needle in dom.stdout, needle
    shot = tmp_path / "shot.png"
    snap = subprocess.run(common + [f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert snap.returncode == 0 and shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 20_000


def test_every_bad_override_is_reported_at_once(tmp_path, capsys):
    assert health_cli(["report", "--cluster", "local", "cluster.nodes=0", "health.alltoall.iters=0"]) == 2
    out = capsys.readouterr().out
    assert "2 problems" in out and "cluster.nodes" in out and "health.alltoall.iters" in out
