"""DCGM diagnostics: run `dcgmi diag -r <level> --fail-early -j` on this node and judge its JSON.

The parser reads the format DCGM's validation suite writes (DCGM 2.x/3.x):

    {"DCGM GPU Diagnostic": {"test_categories": [
        {"category": "Deployment" | "Integration" | "Hardware" | "Stress" | ...,
         "tests": [{"name": "...", "results": [
             {"gpu_ids": "0" (or "0,1,..." for software tests), "status": "Pass" | "Fail" | "Warn" | "Skip",
              "warnings": ["text" | {"warning": "text", "error_id": N, "error_category": C, ...}],
              "info": ["text"]}]}]}],
     "version": "3.3.5"}}

and, tolerantly, the DCGM 4 shape where "tests" sit under the root and results name an "entity_id". Text before the
JSON document (dcgmi prints deprecation notes there) is skipped. NVIDIA publishes no stable schema, so anything that
does not parse is a failed check with the raw output kept, never a silent pass.

Where dcgmi comes from: `MOE_HEALTH_DCGMI_DIR/<node>/dcgmi` when that file exists (how the Slurm tests put a
test double on chosen nodes, see data/dcgmi_double.sh), else `dcgmi` on PATH, else the check is `unavailable` and
`health.dcgm.required` decides whether that blocks the node.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from moe_launch.conf.schema import DcgmConfig
from moe_launch.health.result import CHECK_DCGM, CheckResult

DCGMI_DIR_ENV = "MOE_HEALTH_DCGMI_DIR"
DATA_DIR = Path(__file__).parent / "data"

_STATUS_WORDS = {
    "pass": "pass", "passed": "pass",
    "fail": "fail", "failed": "fail", "error": "fail",
    "warn": "warn", "warning": "warn",
    "skip": "skip", "skipped": "skip", "not run": "skip", "notrun": "skip", "n/a": "skip",
}


class DcgmParseError(ValueError):
    """dcgmi printed something that is not a diagnostic document."""


@dataclass
class DcgmTestResult:
    category: str
    test: str
    gpus: str  # "3", or "0,1,2,3" for tests DCGM runs once for all GPUs
    status: str  # pass | fail | warn | skip
    messages: list[str] = field(default_factory=list)
    error_ids: list[int] = field(default_factory=list)
    error_categories: list[int] = field(default_factory=list)


@dataclass
class DcgmReport:
    version: str
    results: list[DcgmTestResult]

    def with_status(self, status: str) -> list[DcgmTestResult]:
        return [r for r in self.results if r.status == status]


def _extract_document(text: str) -> dict[str, Any]:
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        raise DcgmParseError("no JSON object in dcgmi output")
    try:
        doc = json.loads(text[start : end + 1])
    except json.JSONDecodeError as e:
        raise DcgmParseError(f"dcgmi output is not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise DcgmParseError("dcgmi JSON is not an object")
    return doc


def _normalise_status(raw: Any) -> str:
    word = " ".join(str(raw).strip().lower().split())
    return _STATUS_WORDS.get(word, "fail")  # an unknown verdict is not a pass


def _messages(entry: dict[str, Any]) -> tuple[list[str], list[int], list[int]]:
    texts, ids, cats = [], [], []
    for key in ("warnings", "errors"):
        for w in entry.get(key) or []:
            if isinstance(w, dict):
                texts.append(str(w.get("warning") or w.get("message") or w.get("error") or w))
                if "error_id" in w:
                    ids.append(int(w["error_id"]))
                if "error_category" in w:
                    cats.append(int(w["error_category"]))
            else:
                texts.append(str(w))
    return texts, ids, cats


def _result(category: str, test: str, entry: dict[str, Any]) -> DcgmTestResult:
    gpus = entry.get("gpu_ids", entry.get("entity_id", "all"))
    texts, ids, cats = _messages(entry)
    return DcgmTestResult(category, test, str(gpus), _normalise_status(entry.get("status")), texts, ids, cats)


def parse_dcgm_json(text: str) -> DcgmReport:
    doc = _extract_document(text)
    root = doc.get("DCGM GPU Diagnostic") or doc.get("DCGM Diagnostic") or doc
    if not isinstance(root, dict):
        raise DcgmParseError("unexpected top-level value in dcgmi JSON")
    tests: list[tuple[str, dict[str, Any]]] = []
    for cat in root.get("test_categories") or []:
        if isinstance(cat, dict):
            tests += [(str(cat.get("category", "?")), t) for t in cat.get("tests") or [] if isinstance(t, dict)]
    tests += [(str(t.get("category", "?")), t) for t in root.get("tests") or [] if isinstance(t, dict)]
    results = [
        _result(category, str(t.get("name", "?")), entry)
        for category, t in tests
        for entry in t.get("results") or []
        if isinstance(entry, dict)  # DCGM leaves nulls in arrays for GPUs it did not test
    ]
    if not results:
        raise DcgmParseError("dcgmi JSON holds no test results")
    return DcgmReport(version=str(root.get("version", "?")), results=results)


def judge(report: DcgmReport) -> tuple[str, list[str]]:
    """Node verdict: any Fail fails the node, else any Warn warns; reasons name test, GPU and DCGM's message."""
    def line(r: DcgmTestResult) -> str:
        msg = "; ".join(r.messages) or "no message"
        return f"dcgm {r.category}/{r.test} gpu {r.gpus}: {r.status} ({msg})"

    fails, warns = report.with_status("fail"), report.with_status("warn")
    if fails:
        return "fail", [line(r) for r in fails]
    if warns:
        return "warn", [line(r) for r in warns]
    return "pass", []


def dcgmi_command(cfg: DcgmConfig) -> list[str]:
    return ["diag", "-r", str(cfg.level), "--fail-early", "-j"]


def find_dcgmi(node: str) -> Optional[str]:
    override = os.environ.get(DCGMI_DIR_ENV)
    if override:
        candidate = Path(override) / node / "dcgmi"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("dcgmi")


def result_from_output(node: str, stdout: str, returncode: int, raw_path: Optional[Path]) -> CheckResult:
    """Pure: dcgmi's output and exit code -> the node's DCGM CheckResult."""
    details: dict[str, Any] = {"returncode": returncode, "raw": str(raw_path) if raw_path else None}
    try:
        report = parse_dcgm_json(stdout)
    except DcgmParseError as e:
        tail = stdout.strip()[-300:]
        why = f"dcgm output unreadable ({e}), exit {returncode}: {tail}"
        return CheckResult(node, CHECK_DCGM, "fail", reasons=[why], details=details)
    status, reasons = judge(report)
    if status == "pass" and returncode != 0:
        # dcgmi disagrees with its own document: trust the exit code, keep the document for a human
        status, reasons = "fail", [f"dcgmi exited {returncode} although every parsed test passed"]
    details.update(version=report.version, tests=len(report.results),
                   failed_gpus=sorted({r.gpus for r in report.with_status("fail")}))
    return CheckResult(node, CHECK_DCGM, status, reasons=reasons, details=details)


def run_dcgm(node: str, cfg: DcgmConfig, raw_dir: Path) -> CheckResult:
    """Side effect: run dcgmi on this node, keep its raw output under raw_dir, return the verdict."""
    exe = find_dcgmi(node)
    if exe is None:
        if cfg.required:
            return CheckResult(node, CHECK_DCGM, "fail", reasons=[
                "dcgmi not found on this node and health.dcgm.required=true: install DCGM or set "
                "health.dcgm.required=false"])
        return CheckResult(node, CHECK_DCGM, "unavailable", reasons=["dcgmi not found (health.dcgm.required=false)"])
    raw_path = raw_dir / f"{node}.dcgm.txt"
    raw_dir.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run([exe, *dcgmi_command(cfg)], capture_output=True, text=True, timeout=cfg.timeout_s)
    except subprocess.TimeoutExpired:
        return CheckResult(node, CHECK_DCGM, "fail", reasons=[
            f"dcgmi diag did not finish in health.dcgm.timeout_s={cfg.timeout_s}s: raise it or inspect the node"])
    raw_path.write_text(proc.stdout + ("\n--- stderr ---\n" + proc.stderr if proc.stderr else ""))
    return result_from_output(node, proc.stdout, proc.returncode, raw_path)
