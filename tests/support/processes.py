"""Rank processes and crash children the tests start, each joined with a guard against a hang."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def launch_ranks(
    worker: Path,
    root: Path,
    world_size: int,
    config: dict,
    remote=None,
    killed: int | None = None,
    *,
    env_by_rank: Mapping[int, Mapping[str, str]] | None = None,
    limit: float = 300,
) -> dict[int, dict]:
    """Run ``world_size`` processes of ``worker`` (one job, joined through a file store, over
    ``root/nodes``) with ``config``; return each rank's result (``<results>/rank-<r>.json``).

    ``killed`` is the rank expected to SIGKILL itself (it leaves no result). ``env_by_rank``
    adds variables to some ranks' environments. A process still running after ``limit``
    seconds fails the test (a guard against a hang).
    """
    launch = root / f"launch-{len(list(root.glob('launch-*')))}"
    (launch / "results").mkdir(parents=True)
    config = {
        "store": str(launch / "store"),
        "results": str(launch / "results"),
        "local_root": str(root / "nodes"),
        "world_size": world_size,
        **config,
    }
    if remote is not None:
        config["url"], config["options"] = remote
    (launch / "config.json").write_text(json.dumps(config))
    environments = env_by_rank or {}
    processes = [
        subprocess.Popen(
            [sys.executable, str(worker), str(launch / "config.json"), str(rank)],
            env={**os.environ, **environments.get(rank, {})},
        )
        for rank in range(world_size)
    ]
    try:
        codes = [process.wait(timeout=limit) for process in processes]  # a guard against a hang, not a timing
    finally:
        for process in processes:
            process.kill()
    for rank, code in enumerate(codes):
        assert code == (-signal.SIGKILL if rank == killed else 0), f"rank {rank} exited with {code}"
    return {
        rank: json.loads((launch / "results" / f"rank-{rank}.json").read_text())
        for rank in range(world_size)
        if rank != killed
    }


def running_as_root() -> bool:
    return os.geteuid() == 0


CHILD = Path(__file__).resolve().parent / "crash_child.py"
BYTES_PER_RANK = 64 * 1024 * 1024


def kill_child_at(directory: Path, point: str, *mode: str, bytes_per_rank: int = BYTES_PER_RANK) -> None:
    """Run a child saving 4 ranks into ``directory``; SIGKILL it once it reaches ``point``."""
    kill_when_told([sys.executable, str(CHILD), str(directory), point, str(bytes_per_rank), *mode], point)


def kill_when_told(command: list[str], point: str, told: tuple[str, ...] = ("PAUSED\n",)) -> str:
    """Run ``command``, a child that prints one of ``told`` once it reaches ``point`` and then
    blocks; SIGKILL it once it said so, and return what it said."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        # A guard against a hung child, not a timing assumption: the child signals readiness.
        ready, _, _ = select.select([child.stdout], [], [], 300)
        assert ready, f"child never reached {point}"
        said = child.stdout.readline()
        assert said in told, f"child said {said!r} at {point}"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    return said
