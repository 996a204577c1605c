"""The trainer's own words about why it exited, read from an attempt's logs.

The trainer prints its refusals (bad config or data, unusable checkpoint, a write error) as one `[trainer] ...` line on
stderr before it exits; srun (cluster=slurm) or the local launcher writes those lines under logs/attempt<K>/. The
supervisor appends the last such line to a failed step's detail, so the stop reason in the journal, summary.json
and the terminal says what the trainer said instead of only its exit code.
"""

from __future__ import annotations

from pathlib import Path

MARK = "[trainer] "
_TAIL_BYTES = 64 << 10  # the message is printed last; a crashed rank's log can be long
_MAX_CHARS = 600


def last_trainer_message(text: str) -> str:
    """Pure: the text after the last `[trainer] ` mark (srun may prefix lines with a task label or a time)."""
    lines = [ln.split(MARK, 1)[1].strip() for ln in text.splitlines() if MARK in ln]
    return lines[-1][:_MAX_CHARS] if lines else ""


def trainer_message(log_dir: Path) -> str:
    """The last `[trainer]` line over the attempt's log files (the newest file wins ties), or ''."""
    found = ""
    for path in sorted(log_dir.glob("*.log"), key=lambda p: p.stat().st_mtime):
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - _TAIL_BYTES))
                message = last_trainer_message(f.read().decode(errors="replace"))
        except OSError:
            continue
        found = message or found
    return found
