"""History store, quarantine/release, the rich report and report.html (opened in headless Chromium when present)."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess

import pytest
from rich.console import Console

from moe_launch.conf.schema import HealthConfig
from moe_launch.health import report, store
from moe_launch.health.cli import main as health_cli
from moe_launch.health.cli import parse_since
from moe_launch.health.result import CheckResult

HOUR = 3600.0
NOW = 1_800_000_000.0


def _history(cdir) -> None:
    """Three days of a 4-node cluster: node3 fails DCGM in three runs, a2a over 4 then 3 nodes, one slow day."""
    for day, busbw in enumerate([0.90, 0.88, 0.30]):
        t = NOW - (2 - day) * 24 * HOUR + 60
        run = f"run{day}"
        results = [CheckResult(n, "dcgm", "pass", time=t) for n in ("node1", "node2", "node4")]
        results.append(CheckResult("node3", "dcgm", "fail", time=t, reasons=[
            "dcgm Hardware/Diagnostic gpu 3: fail (thermal violation)"]))
        results += [CheckResult(n, "compute", "pass", value=700.0 - 50 * (n == "node4") * day, time=t)
                    for n in ("node1", "node2", "node4")]
        group = ["node1", "node2", "node4"]
        results += [CheckResult(n, "alltoall", "pass" if busbw > 0.5 else "fail", value=busbw,
                                details={"group_nodes": group}, time=t) for n in group]
        results += [CheckResult(n, "alltoall", "pass", value=1.3, details={"group_nodes": ["node1", "node2"]},
                                time=t + 10) for n in ("node1", "node2")]
        store.append_results(cdir, results, run)


def test_quarantine_decision_is_pure_and_windowed():
    hist = [{"node": "n1", "check": "dcgm", "status": "fail", "time": NOW - h * HOUR, "run": f"r{h}"}
            for h in (1, 2, 30)]
    hist.append({"node": "n1", "check": "dcgm", "status": "fail", "time": NOW - 1 * HOUR, "run": "r1"})  # same run
    hist.append({"node": "n2", "check": "alltoall", "status": "fail", "time": NOW, "run": "x"})  # group: nobody's
    assert store.quarantine_decision(hist, {}, k=2, window_h=24, now=NOW) == {"n1": 2}
    assert store.quarantine_decision(hist, {}, k=3, window_h=24, now=NOW) == {}
    assert store.quarantine_decision(hist, {}, k=3, window_h=48, now=NOW) == {"n1": 3}
    assert store.quarantine_decision(hist, {"n1": NOW - 1.5 * HOUR}, k=2, window_h=24, now=NOW) == {}


def test_quarantine_and_release(tmp_path):
    cfg = HealthConfig(store_dir=str(tmp_path), quarantine_failures=3, quarantine_window_h=72)
    cdir = store.cluster_dir(cfg, "c1")
    _history(cdir)
    data = store.update_quarantine(cdir, cfg, now=NOW)
    assert list(data["quarantined"]) == ["node3"] and data["quarantined"]["node3"]["failures"] == 3
    assert store.release(cdir, "node3", now=NOW + 1)
    assert store.quarantined_nodes(cdir) == {}
    store.update_quarantine(cdir, cfg, now=NOW + 2)  # released failures no longer count
    assert store.quarantined_nodes(cdir) == {}
    assert not store.release(cdir, "node1")


def test_summaries_and_series(tmp_path):
    cdir = tmp_path / "c"
    _history(cdir)
    hist = store.read_history(cdir)
    sums = {s.node: s for s in report.summarize(hist, {"node3": {}}, since=None)}
    assert sums["node3"].failures == 3 and sums["node3"].quarantined and sums["node3"].last == {"dcgm": "fail"}
    assert report.compute_series(hist, since=None)["node4"] == [(NOW - 48 * HOUR + 60, 700.0),
                                                                 (NOW - 24 * HOUR + 60, 650.0), (NOW + 60, 600.0)]
    tests, nodes, cells = report.dcgm_matrix(hist, since=None)
    assert tests == ["Hardware/Diagnostic"] and nodes == ["node1", "node2", "node3", "node4"]
    assert cells[("Hardware/Diagnostic", "node3")] == "fail" and cells[("Hardware/Diagnostic", "node1")] == "pass"
    fails = report.failure_rows(hist, {"node3": {}}, since=None)
    assert [f["node"] for f in fails] == ["node3"] * 3 and fails[0]["quarantined"]
    assert "thermal violation" in fails[0]["reasons"]
    assert sums["node4"].a2a_busbw == [0.90, 0.88, 0.30]
    series = report.a2a_series(hist, since=None)
    assert sorted(series) == [2, 3]
    assert [v for _, v in series[3]] == [0.90, 0.88, 0.30]  # one point per run, not one per node
    assert report.failures_per_node(hist, since=NOW - 30 * HOUR) == {"node1": 0, "node2": 0, "node3": 2, "node4": 0}
    assert report.sparkline([1, 2, 3]) == "▁▄█"


def test_parse_since():
    assert parse_since("24h", now=NOW) == NOW - 24 * HOUR
    assert parse_since("7d", now=NOW) == NOW - 7 * 24 * HOUR
    assert parse_since("1700000000") == 1_700_000_000.0
    assert parse_since(None) is None
    with pytest.raises(Exception, match="--since"):
        parse_since("yesterday")


def _decode_images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def test_report_cli_table_and_html(tmp_path, capsys):
    store_dir = tmp_path / "store"
    cdir = store_dir / "c1"
    _history(cdir)
    html_path = tmp_path / "out" / "report.html"
    rc = health_cli(["report", "--html", str(html_path), "--cluster", "local", "cluster.name=c1",
                     f"health.store_dir={store_dir}"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "moe-health report: cluster c1" in out and "node3" in out and "alltoall" in out
    page = html_path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    for node in ("node1", "node2", "node3", "node4"):
        assert f"<td>{node}</td>" in page
    assert '<table id="dcgm">' in page and '<table id="failures">' in page and "thermal violation" in page
    images = _decode_images(page)  # all-to-all per node count, GEMM per node
    assert len(images) == 2 and all(img.startswith(b"\x89PNG\r\n\x1a\n") for img in images)
    import matplotlib.image as mpimg

    for img in images:
        assert mpimg.imread(io.BytesIO(img), format="png").shape[0] > 100
    # the rich table renders to a fixed-width console too
    console = Console(width=160, record=True)
    console.print(report.build(store.read_history(cdir), {}, None, "c1", None))
    assert "0.3" in console.export_text()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian package `chromium` (apt-get install chromium)")
def test_report_html_opens_in_headless_chromium(tmp_path):
    cdir = tmp_path / "store" / "c1"
    _history(cdir)
    html_path = tmp_path / "report.html"
    report.build(store.read_history(cdir), {"node3": {}}, None, "c1", html_path)
    shot = tmp_path / "report.png"
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(common + ["--dump-dom", html_path.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert '<table id="nodes">' in dom.stdout and "<td>node3</td>" in dom.stdout
    console_errors = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console_errors == []
    snap = subprocess.run(common + [f"--screenshot={shot}", "--window-size=1280,1400", html_path.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert snap.returncode == 0, snap.stderr[-2000:]
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000
