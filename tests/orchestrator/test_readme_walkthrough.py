"""The README's walkthrough, run line by line as written (own text -> prepare -> train -> report -> export -> load in
transformers and generate), in a fresh directory on the CPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def walkthrough_blocks(readme: str) -> tuple[list[str], str]:
    """(bash command lines, python snippet) of the marked walkthrough blocks."""
    def block(marker: str, lang: str) -> str:
        m = re.search(rf"<!-- walkthrough:{marker} -->\n```{lang}\n(.*?)```", readme, re.S)
        assert m, f"README lost its walkthrough:{marker} block"
        return m.group(1)

    joined = block("bash", "bash").replace("\\\n", " ")  # continuation lines make one command
    return [ln for ln in joined.splitlines() if ln.strip()], block("python", "python")


def test_readme_walkthrough_runs(tmp_path):
    pytest.importorskip("transformers")
    commands, snippet = walkthrough_blocks((REPO / "README.md").read_text())
    assert len(commands) == 5
    outputs = []
    for line in commands:
        cmd = line.replace(".venv/bin/", f"{VENV_BIN}/")
        proc = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, timeout=400,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (line, proc.stdout[-3000:], proc.stderr[-3000:])
        outputs.append(proc.stdout)
    assert "step 6/6 | loss" in outputs[2]  # the training command's output is a pipe here: it shows the steps
    run = tmp_path / "runs" / "mine"
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert (run / "plots" / "report.html").exists() and (run / "plots" / "expert_load.png").exists()
    logs = "".join(p.read_text() for p in (run / "logs").rglob("*.log"))
    assert "[local1 r0] step 6/6 | loss" in logs  # the plain step log line
    assert (tmp_path / "data" / "mine" / "tokenizer.json").exists()
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("def dumps(obj")  # the prompt, decoded back, then 20 generated tokens
