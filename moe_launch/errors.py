"""The small exception hierarchy of moe-launch. Every message says what to do next."""


class MoeLaunchError(Exception):
    """Base class: anything moe-launch raises on purpose."""


class ConfigError(MoeLaunchError, ValueError):
    """An impossible configuration value. The message names the dotted key and the fix."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key = key
        super().__init__(f"{key}: {problem}. Fix: {fix}")


class SubmissionError(MoeLaunchError):
    """Slurm refused or lost a job; carries the tail of the relevant output."""


class NodeHealthError(MoeLaunchError):
    """A node failed a health check and must not be used."""


class CheckpointError(MoeLaunchError):
    """No usable checkpoint, or a checkpoint that does not match the run."""


class DataError(MoeLaunchError):
    """Training data missing or malformed (wrong dtype, shape, vocabulary)."""
