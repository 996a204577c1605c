"""DCGM parser and verdicts on recorded `dcgmi diag -j` documents, and the dcgmi test double end to end."""

from __future__ import annotations

import json

import pytest

from moe_launch.conf.schema import DcgmConfig
from moe_launch.health.dcgm import (
    DATA_DIR,
    DCGMI_DIR_ENV,
    DcgmParseError,
    judge,
    parse_dcgm_json,
    result_from_output,
    run_dcgm,
)
from moe_launch.health.dcgm_double import install_double


def _load(name: str) -> str:
    return (DATA_DIR / name).read_text()


def test_pass_document():
    report = parse_dcgm_json(_load("dcgm_pass.json"))
    assert report.version == "3.3.5"
    assert len(report.results) == 9 and {r.status for r in report.results} == {"pass"}
    assert report.results[0].category == "Deployment" and report.results[0].gpus == "0,1,2,3,4,5,6,7"
    assert judge(report) == ("pass", [])


def test_warning_document():
    status, reasons = judge(parse_dcgm_json(_load("dcgm_warn.json")))
    assert status == "warn"
    assert len(reasons) == 1 and "Persistence Mode" in reasons[0] and "persistence mode" in reasons[0].lower()


def test_level1_memory_failure():
    report = parse_dcgm_json(_load("dcgm_fail_memory.json"))
    [bad] = report.with_status("fail")
    assert bad.test == "Page Retirement/Row Remap" and bad.error_ids == [83] and bad.error_categories == [10]
    status, reasons = judge(report)
    assert status == "fail" and "GPU 6" in reasons[0]


def test_thermal_pcie_memory_failures_name_each_gpu():
    report = parse_dcgm_json(_load("dcgm_fail_thermal_pcie_memory.json"))
    fails = report.with_status("fail")
    by_test = {}
    for r in fails:
        by_test.setdefault(r.test, []).append(r.gpus)
    assert by_test == {"PCIe": ["3"], "GPU Memory": ["5"], "Diagnostic": ["1", "2", "4"]}
    thermal = [r for r in fails if r.test == "Diagnostic"]
    assert all(r.error_categories == [9] and "Thermal violations" in r.messages[0] for r in thermal)
    # 8 GPUs x 3 per-GPU tests + 9 deployment tests
    assert len(report.results) == 8 * 3 + 9
    result = result_from_output("node7", _load("dcgm_fail_thermal_pcie_memory.json"), 226, None)
    assert result.status == "fail" and result.details["failed_gpus"] == ["1", "2", "3", "4", "5"]
    assert len(result.reasons) == 5


def test_preamble_nulls_and_dcgm4_shape():
    doc = json.loads(_load("dcgm_pass.json"))
    doc["DCGM GPU Diagnostic"]["test_categories"][0]["tests"][0]["results"].append(None)
    text = "Warning: deprecated option\n" + json.dumps(doc)
    assert judge(parse_dcgm_json(text))[0] == "pass"
    v4 = {"DCGM Diagnostic": {"version": "4.2.3", "tests": [
        {"name": "memory", "category": "Hardware", "results": [{"entity_id": 0, "status": "Pass"},
                                                               {"entity_id": 1, "status": "Fail",
                                                                "warnings": [{"warning": "bad", "error_id": 9}]}]}]}}
    report = parse_dcgm_json(json.dumps(v4))
    assert [(r.gpus, r.status) for r in report.results] == [("0", "pass"), ("1", "fail")]


@pytest.mark.parametrize(
    "text", ["", "dcgmi: Error connecting to host engine", '{"DCGM GPU Diagnostic": {}}', "{oops}"])
def test_unreadable_output_fails_never_passes(text):
    if text.startswith('{"DCGM'):
        with pytest.raises(DcgmParseError):
            parse_dcgm_json(text)
    result = result_from_output("node1", text, 1, None)
    assert result.status == "fail" and "unreadable" in result.reasons[0]


def test_exit_code_overrides_an_all_pass_document():
    result = result_from_output("node1", _load("dcgm_pass.json"), 3, None)
    assert result.status == "fail"


def test_double_and_unavailable(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no real dcgmi here
    monkeypatch.setenv(DCGMI_DIR_ENV, str(tmp_path / "doubles"))
    install_double(tmp_path / "doubles", "node3", "dcgm_fail_memory.json", returncode=226)
    bad = run_dcgm("node3", DcgmConfig(), tmp_path / "raw")
    assert bad.status == "fail" and bad.details["returncode"] == 226
    assert "Row Remap" in (tmp_path / "raw" / "node3.dcgm.txt").read_text()
    absent = run_dcgm("node1", DcgmConfig(), tmp_path / "raw")
    assert absent.status == "unavailable"
    required = run_dcgm("node1", DcgmConfig(required=True), tmp_path / "raw")
    assert required.status == "fail" and "health.dcgm.required" in required.reasons[0]
