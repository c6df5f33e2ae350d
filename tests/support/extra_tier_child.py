"""Child process for tests/test_extra_tiers.py: a job with one tier of the caller's own, killed.

Usage: python extra_tier_child.py KIND LOCAL OTHER [BUCKET]

KIND "disk": a second disk tier (:class:`support.disk_tier.DiskTier`) at OTHER, next to a
bucket at the ``file://`` URL BUCKET; KIND "redis": a shared memory tier whose entries are
files in OTHER (:class:`support.memory_tier.MemoryTier`, standing for Redis). The job saves
STEPS (two ranks each, :func:`states`), waits for each step to be committed in that tier,
prints "SAVED" and blocks until the parent kills it (SIGKILL).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support.disk_tier import DiskTier  # noqa: E402
from support.memory_tier import MemoryTier  # noqa: E402
from tiered_ckpt import CheckpointManager, LocalOptions, RemoteOptions, TierOptions  # noqa: E402

STEPS = (1, 2, 3)
WORLD_SIZE = 2


def states(step: int) -> list[dict[str, object]]:
    """Each rank's state at ``step``: the same on every call."""
    return [
        {
            "w": np.random.default_rng(step * 10 + rank).standard_normal((64, 32)).astype(np.float32),
            "moments": {"m": np.arange(step * 100 + rank, step * 100 + rank + 257, dtype=np.int64)},
            "step": step,
        }
        for rank in range(WORLD_SIZE)
    ]


def extra_tier(kind: str, other: Path) -> TierOptions:
    """The tier of the caller's own the job adds, with its retention."""
    if kind == "disk":
        return TierOptions(DiskTier(other, "disk2"), keep_last=2)
    return TierOptions(MemoryTier("redis", shared=True, directory=other), keep_last=1)


def manager(kind: str, local: Path, other: Path, bucket: str | None) -> CheckpointManager:
    remote = RemoteOptions(bucket) if bucket is not None else None
    return CheckpointManager(
        LocalOptions(local, keep_last=3), remote=remote, tiers=[extra_tier(kind, other)], world_size=WORLD_SIZE
    )


def main() -> None:
    kind, local, other = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    bucket = sys.argv[4] if len(sys.argv) > 4 else None
    job = manager(kind, local, other, bucket)
    name = "disk2" if kind == "disk" else "redis"
    for step in STEPS:
        handle = job.save(step, states(step))
        handle.replicated[name].result(timeout=120)
        if handle.uploaded is not None:
            handle.uploaded.result(timeout=120)
    print("SAVED", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
