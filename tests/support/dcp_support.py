"""What the DCP backend's tests share: the error a rank raised inside DCP, and jobs of real rank processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from support.processes import launch_ranks

__all__ = ["WORKER", "failure", "run_job"]

WORKER = Path(__file__).resolve().parent / "dcp_worker.py"


def failure(caught: pytest.ExceptionInfo) -> BaseException:
    """The error a rank raised inside DCP (DCP wraps it in a CheckpointException)."""
    error = caught.value
    if isinstance(error, CheckpointException):
        ((error, _trace),) = error.failures.values()
    return error


def run_job(root: Path, actions: list, remote=None) -> dict[int, dict]:
    """Two rank processes running ``actions`` (see dcp_worker.py); each rank's result."""
    return launch_ranks(WORKER, root, 2, {"actions": actions}, remote=remote)
