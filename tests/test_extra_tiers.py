"""Tiers of the caller's own (issue 41, item 3): each added with ``TierOptions`` alone, no
change to the engine or the store, and proven by a whole save -> SIGKILL -> restore.

(a) a second node-local disk (durable, not shared: :mod:`support.disk_tier`) next to a
bucket; (b) a shared, non-durable memory tier standing for Redis (:mod:`support.memory_tier`
over a directory every process shares). The job (:mod:`support.extra_tier_child`) saves three
steps, each committed in its tier, and is killed; its first disk is then lost, and a new job
restores the newest step bit for bit from the added tier, which keeps its own retention.
"""

from __future__ import annotations

import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support import extra_tier_child as child
from support.memory_tier import MemoryTier
from tiered_ckpt import CheckpointManager, TierOptions, UploadError
from tiered_ckpt.tiers.local import LocalTier

CHILD = Path(child.__file__).resolve()


def _kill_after_saving(*arguments: str) -> None:
    """Run the child job with ``arguments``; SIGKILL it once its steps are in its added tier."""
    job = subprocess.Popen([sys.executable, str(CHILD), *arguments], stdout=subprocess.PIPE, text=True)
    try:
        # A guard against a hung child, not a timing assumption: the child says when it is ready.
        ready, _, _ = select.select([job.stdout], [], [], 300)
        assert ready, "the child job never saved its steps"
        assert job.stdout is not None and job.stdout.readline() == "SAVED\n"
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
        assert job.stdout is not None
        job.stdout.close()
    assert job.returncode == -signal.SIGKILL


def _assert_same(restored: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    """Every array bit for bit (dtype, shape, bytes) and every scalar as saved."""
    for got, want in zip(restored, saved, strict=True):
        for array, expected in ((got["w"], want["w"]), (got["moments"]["m"], want["moments"]["m"])):
            assert isinstance(array, np.ndarray) and array.dtype == expected.dtype and array.shape == expected.shape
            assert array.tobytes() == expected.tobytes()
        assert got["step"] == want["step"]


@pytest.mark.slow
def test_a_second_disk_next_to_the_bucket_restores_a_killed_job_whose_first_disk_is_lost(tmp_path):
    local, disk2, bucket = tmp_path / "local", tmp_path / "disk2", tmp_path / "bucket"
    bucket.mkdir()
    _kill_after_saving("disk", str(local), str(disk2), bucket.as_uri())
    assert LocalTier(disk2).steps() == [2, 3]  # its own retention: keep_last=2
    shutil.rmtree(local)  # the first disk is lost

    job = child.manager("disk", local, disk2, bucket.as_uri())
    try:
        assert job.remote_steps() == [1, 2, 3]  # the bucket's retention (keep all) is its own
        result = job.restore()
        assert result.step == 3 and result.sources == {0: "disk2", 1: "disk2"}  # the nearer copy, not the bucket's
        _assert_same(result.states, child.states(3))
        job.wait()
        assert job.steps() == [3]  # the first disk refilled from the second
        handle = job.save(4, child.states(4))
        assert handle.replicated["disk2"].result(timeout=120) is None and handle.uploaded is not None
        assert handle.replicated["remote"] is handle.uploaded and handle.uploaded.result(timeout=120) is None
    finally:
        job.close()
        job.options.tiers[0].tier.release()
    assert LocalTier(disk2).steps() == [3, 4]


@pytest.mark.slow
def test_a_shared_memory_tier_restores_a_killed_job_whose_disk_is_lost(tmp_path):
    local, redis = tmp_path / "local", tmp_path / "redis"
    _kill_after_saving("redis", str(local), str(redis))
    assert MemoryTier("redis", shared=True, directory=redis).steps() == [3]  # its own retention: keep_last=1
    shutil.rmtree(local)

    with child.manager("redis", local, redis, None) as job:
        result = job.restore()
        assert result.step == 3 and result.sources == {0: "redis", 1: "redis"}
        _assert_same(result.states, child.states(3))
        job.wait()
        assert job.steps() == [3]
        handle = job.save(4, child.states(4))
        assert handle.uploaded is None and handle.replicated["redis"].result(timeout=120) is None
    assert MemoryTier("redis", shared=True, directory=redis).steps() == [4]


class _Broken(MemoryTier):
    """A tier whose storage is gone: every landing fails for a reason no retry cures."""

    def land_shard(self, *arguments: Any, **keywords: Any) -> Any:
        raise OSError(f"{self.name}: the device is gone")


def test_each_tier_of_the_callers_own_has_its_future_and_its_errors(tmp_path):
    tiers = [TierOptions(_Broken("broken")), TierOptions(MemoryTier("fine"))]
    with pytest.raises(UploadError, match="copy to the broken tier of step 1 failed.*the device is gone") as raised:
        with CheckpointManager(tmp_path / "local", tiers=tiers, world_size=child.WORLD_SIZE) as job:
            handle = job.save(1, child.states(1))
            assert sorted(handle.replicated) == ["broken", "fine"] and handle.uploaded is None  # no bucket
            assert handle.replicated["fine"].result(timeout=60) is None  # one tier's failure is its own
            assert handle.replicated["broken"].exception(timeout=60) is not None
            assert job.steps() == [1] and tiers[1].tier.steps() == [1] and tiers[0].tier.steps() == []
            job.wait()  # raises it, as the bucket's failures are raised
    assert raised.value.step == 1 and not raised.value.transient
