"""What the manager's calls return: a save's two futures, ``check_for_errors``, and the typed
results of ``pull``, ``push``, ``prune`` and ``verify``."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

import numpy as np
import pytest

from support.states import flip_byte
from tiered_ckpt import (
    CheckpointManager,
    LocalOptions,
    PruneResult,
    PullResult,
    PushResult,
    RemoteOptions,
    SaveError,
    ShardManifest,
    UploadError,
    UploadOptions,
    VerifyResult,
)
from tiered_ckpt.format.layout import shard_name, step_dir_name
from tiered_ckpt.tiers.remote.tier import RemoteTier


def state(step: int) -> list[dict[str, np.ndarray]]:
    return [{"w": np.full(64, step, np.float32)}, {"w": np.full(64, -step, np.float32)}]


def two_tier(tmp_path, url_and_options, keep_last=3, **upload) -> CheckpointManager:
    url, options = url_and_options
    return CheckpointManager(
        LocalOptions(tmp_path / "ckpt", keep_last=keep_last),
        remote=RemoteOptions(url, storage_options=options),
        upload=UploadOptions(**upload),
        world_size=2,
    )


def remove_bucket(url: str, options: dict) -> None:
    tier = RemoteTier(url, options)
    tier.backend.fs.rm(tier.backend.root.split("/")[0], recursive=True)  # no such bucket: permanent
    tier.backend.fs.invalidate_cache()


# -- a save's two futures -------------------------------------------------------------------------


def test_a_save_has_a_future_of_its_local_commit_and_of_its_bucket_commit(tmp_path, memory_url):
    with two_tier(tmp_path, memory_url) as manager:
        handle = manager.save(1, state(1))
        assert isinstance(handle.committed, Future) and isinstance(handle.uploaded, Future)
        manifest = handle.committed.result()
        assert isinstance(manifest, ShardManifest) and manifest.step == 1 and manager.steps() == [1]
        assert handle.uploaded.result() is None and 1 in manager.remote_steps()
        assert "committed=done, uploaded=done" in repr(handle)


def test_without_a_bucket_there_is_no_upload_future(tmp_path):
    with CheckpointManager(tmp_path, world_size=2) as manager:
        handle = manager.save(1, state(1), blocking=True)
        assert handle.committed.done() and handle.uploaded is None
        assert "uploaded=none" in repr(handle)


def test_a_permanent_upload_failure_is_the_exception_of_that_steps_upload_future_and_raised_once(tmp_path, s3_url):
    url, options = s3_url
    manager = two_tier(tmp_path, s3_url)
    manager.save(1, state(1)).uploaded.result()
    remove_bucket(url, options)
    second = manager.save(2, state(2))
    second.committed.result()  # on local disk all the same
    with pytest.raises(UploadError, match="upload of step 2 failed") as caught:
        second.uploaded.result()
    assert caught.value.step == 2 and not caught.value.transient
    manager.check_for_errors()  # raised by the future: not raised again
    manager.save(3, state(3), blocking=True)  # nor by the next save
    assert manager.steps() == [1, 2, 3]
    with pytest.raises(UploadError, match="upload of step 3 failed"):
        manager.close()


def test_a_failed_save_fails_both_of_its_futures(tmp_path, memory_url, monkeypatch):
    from tiered_ckpt.tiers.local import LocalTier

    def refuse(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    with two_tier(tmp_path, memory_url) as manager:
        monkeypatch.setattr(LocalTier, "commit", refuse)
        handle = manager.save(1, state(1))
        with pytest.raises(SaveError, match="No space left") as caught:
            handle.committed.result()
        assert handle.uploaded.exception() is caught.value  # the step will never be in the bucket
        manager.check_for_errors()  # raised once, by the future
        monkeypatch.undo()
        assert manager.save(2, state(2)).uploaded.result() is None


def test_a_step_superseded_in_a_full_queue_fails_its_upload_future_as_transient(tmp_path, memory_url, monkeypatch):
    release = threading.Event()
    started = threading.Event()
    original = RemoteTier.land_shard

    def held(tier, *args, **kwargs):
        started.set()
        release.wait()
        return original(tier, *args, **kwargs)

    monkeypatch.setattr(RemoteTier, "land_shard", held)
    with two_tier(tmp_path, memory_url, max_pending=1, when_behind="skip") as manager:
        first = manager.save(1, state(1), blocking=True)
        started.wait()  # step 1 is being uploaded, held
        second = manager.save(2, state(2), blocking=True)  # queued
        third = manager.save(3, state(3), blocking=True)  # the queue is full: step 2 is dropped
        error = second.uploaded.exception()
        assert isinstance(error, UploadError) and error.transient and "superseded by step 3" in str(error)
        release.set()
        assert first.uploaded.result() is None and third.uploaded.result() is None
        assert manager.remote_steps() == [1, 3]


def test_check_for_errors_raises_a_pending_background_error_once(tmp_path, s3_url):
    url, options = s3_url
    manager = two_tier(tmp_path, s3_url)
    manager.check_for_errors()  # nothing pending: nothing raised
    manager.save(1, state(1)).uploaded.result()
    remove_bucket(url, options)
    manager.save(2, state(2)).uploaded.exception()  # observed, not raised: still pending
    with pytest.raises(UploadError, match="upload of step 2 failed"):
        manager.check_for_errors()
    manager.check_for_errors()  # once
    manager.close()


# -- typed results ----------------------------------------------------------------------------------


def test_push_pull_prune_and_verify_say_what_they_did(tmp_path, memory_url):
    url, options = memory_url
    with CheckpointManager(
        LocalOptions(tmp_path / "a", keep_last=1), remote=RemoteOptions(url, storage_options=options), world_size=2
    ) as manager:
        for step in (1, 2):
            manager.save(step, state(step), blocking=True)
        manager.wait(uploaded=True)
        assert manager.prune(dry_run=True) == PruneResult({"local": (), "remote": ()}, (), (), dry_run=True)
        assert manager.push() == PushResult(())  # every step is in the bucket already
        verified = manager.verify()
        assert isinstance(verified, VerifyResult) and verified.ok and not verified.failed
        assert {(check.step, check.tier) for check in verified.checks} == {(2, "local"), (1, "remote"), (2, "remote")}
    flip_byte(tmp_path / "a" / step_dir_name(2) / shard_name(1, 2), 200)
    with CheckpointManager(tmp_path / "a", remote=RemoteOptions(url, storage_options=options), world_size=2) as again:
        (failed,) = again.verify(2).failed
        assert (failed.step, failed.tier, failed.rank, failed.status) == (2, "local", 1, "failed")
        pulled = again.pull(2)
        assert pulled == PullResult(2, {0: "local", 1: "remote"})  # the damaged shard came from the bucket
        assert again.verify(2).ok
    results = (PullResult, PushResult, PruneResult, VerifyResult)
    assert all(dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen for kind in results)
