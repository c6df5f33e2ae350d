import errno
import logging
import os
import shutil
import subprocess
import threading
from pathlib import PurePosixPath

import numpy as np
import pytest

from support.processes import BYTES_PER_RANK, kill_child_at, running_as_root
from support.states import ZERO1_SHARDED_KEYS, assert_states_equal, flip_byte, large_states, temp_files, zero1_states
from support.stores import CLOUDS, REMOTES, with_slow
from tiered_ckpt import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointManager,
    ChecksumMismatchError,
    ConfigError,
    DirectoryInUseError,
    IncompleteCheckpointError,
    InvalidStateError,
    LocalOptions,
    ManifestError,
    RemoteError,
    RemoteOptions,
    RestoreOptions,
    RuntimeOptions,
    SaveError,
    UploadError,
    UploadOptions,
    UsageError,
    WorldSizeMismatchError,
)
from tiered_ckpt.build import open_remote_tier
from tiered_ckpt.format.layout import MANIFEST_NAME, RECEIPT_NAME, parse_step_dir_name, shard_name, step_dir_name
from tiered_ckpt.io.durable import temp_name
from tiered_ckpt.tiers.remote.backends.wrappers import Counting
from tiered_ckpt.tiers.remote.tier import HASHED_FROM_RANKS, RemoteTier

ZERO1 = RuntimeOptions(sharded_keys=ZERO1_SHARDED_KEYS)


@pytest.fixture
def manager(tmp_path):
    with CheckpointManager(tmp_path / "ckpt", world_size=4, runtime=ZERO1) as manager:
        yield manager


def test_async_save_then_restore_round_trips(manager, states):
    handle = manager.save(100, states)
    manifest = handle.committed.result()
    assert handle.committed.done() and handle.committed.result() == manifest and manifest.step == 100
    assert handle.step == 100 and handle.uploaded is None  # no remote tier
    result = manager.restore()
    assert result.step == 100
    assert result.sources == {0: "local", 1: "local", 2: "local", 3: "local"}
    assert_states_equal(states, result.states)
    assert manager.steps() == [100] and manager.latest_step() == 100
    assert sorted(os.listdir(manager.root)) == [step_dir_name(100)]


def test_caller_may_overwrite_arrays_once_save_returns(tmp_path):
    states = large_states(4, 16 * 1024 * 1024)
    expected = [{key: array.copy() for key, array in state.items()} for state in states]
    with CheckpointManager(tmp_path, world_size=4) as manager:
        manager.save(1, states)
        for state in states:
            for array in state.values():
                array.fill(-1)
        manager.wait()
        assert_states_equal(expected, manager.restore().states)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux's")
def test_the_writer_runs_on_the_cpus_it_is_given_and_the_training_thread_is_left_alone(tmp_path, states):
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    runtime = RuntimeOptions(sharded_keys=ZERO1_SHARDED_KEYS, writer_cpus={cpu})
    with CheckpointManager(tmp_path, world_size=4, runtime=runtime) as manager:
        manager.save(1, states)
        manager.wait()
        writer = next(thread for thread in threading.enumerate() if thread.name.startswith("tiered-ckpt-writer"))
        assert os.sched_getaffinity(writer.native_id) == {cpu}
        assert os.sched_getaffinity(0) == before  # the caller's thread
        assert manager.restore().step == 1


@pytest.mark.parametrize("cpus", [[], {10**6}, 3, "0"])
def test_writer_cpus_that_cannot_be_used_are_refused(tmp_path, cpus):
    with pytest.raises(ConfigError, match="writer_cpus"):
        CheckpointManager(tmp_path, world_size=1, runtime=RuntimeOptions(writer_cpus=cpus))
    CheckpointManager(tmp_path, world_size=1).close()  # nothing was left holding the directory


def test_blocking_save_and_several_steps(manager, states):
    for step in (10, 20, 30):
        manager.save(step, states, blocking=True)
    assert manager.steps() == [10, 20, 30]
    assert manager.restore(20).step == 20


def test_retention_keeps_the_newest_and_every_tenth(tmp_path):
    with CheckpointManager(LocalOptions(tmp_path, keep_last=2, keep_every=10), world_size=2, runtime=ZERO1) as manager:
        for step in range(1, 26):
            manager.save(step, zero1_states(2, 64, seed=step), blocking=step % 5 == 0)
        manager.wait()
        assert manager.steps() == [10, 20, 24, 25]
        assert sorted(os.listdir(tmp_path)) == [step_dir_name(s) for s in (10, 20, 24, 25)]
        assert_states_equal(zero1_states(2, 64, seed=10), manager.restore(10).states)


def test_retention_never_deletes_the_newest_step(tmp_path, states):
    with CheckpointManager(LocalOptions(tmp_path, keep_last=1), world_size=4, runtime=ZERO1) as manager:
        for step in (1, 2, 3):
            manager.save(step, states)
        manager.wait()
        assert manager.steps() == [3]


def test_step_must_be_newer_than_every_committed_step(manager, states):
    manager.save(5, states, blocking=True)
    for step in (5, 4):
        with pytest.raises(CheckpointExistsError, match="not newer than the newest checkpoint, step 5"):
            manager.save(step, states)


def test_bad_input_is_refused_at_the_call_and_writes_nothing(manager, states):
    with pytest.raises(InvalidStateError, match="world_size is 4 but 3 rank states"):
        manager.save(1, states[:3])
    states[1]["bad"] = np.ones(2, "datetime64[s]")
    with pytest.raises(InvalidStateError, match=r'rank 1: state\["bad"\] has dtype datetime64\[s\]'):
        manager.save(1, states)
    assert os.listdir(manager.root) == []


def test_a_second_manager_on_the_same_directory_is_refused(tmp_path):
    with CheckpointManager(tmp_path, world_size=1):
        with pytest.raises(DirectoryInUseError):
            CheckpointManager(tmp_path, world_size=1)
    CheckpointManager(tmp_path, world_size=1).close()


def test_start_removes_what_crashed_saves_left_and_nothing_else(tmp_path, states):
    with CheckpointManager(tmp_path, world_size=4, runtime=ZERO1) as manager:
        manager.save(1, states, blocking=True)
    committed = tmp_path / step_dir_name(1)
    (committed / temp_name(MANIFEST_NAME)).write_bytes(b"half")
    uncommitted = tmp_path / step_dir_name(2)
    uncommitted.mkdir()
    (uncommitted / "rank-00000-of-00004.safetensors").write_bytes(b"orphan")
    (tmp_path / temp_name("x")).write_bytes(b"")
    (tmp_path / "notes.txt").write_text("mine")
    with CheckpointManager(tmp_path, world_size=4) as manager:
        assert manager.steps() == [1]
        assert_states_equal(states, manager.restore().states)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", step_dir_name(1)]
    assert temp_files(committed) == []


def test_closed_manager_refuses_calls(tmp_path, states):
    manager = CheckpointManager(tmp_path, world_size=4, runtime=ZERO1)
    manager.save(1, states)
    manager.close()
    manager.close()
    assert manager.steps() == [1]
    with pytest.raises(CheckpointError, match="closed"):
        manager.save(2, states)


# --- restore -----------------------------------------------------------------------------


def test_restore_of_a_damaged_newest_step_fails_loudly_and_does_not_fall_back(manager, states):
    manager.save(1, states)
    manager.save(2, zero1_states(seed=2), blocking=True)
    path = manager.root / step_dir_name(2) / "rank-00003-of-00004.safetensors"
    flip_byte(path, 100)
    with pytest.raises(ChecksumMismatchError, match=f"restore of step 2: rank 3 shard {path}"):
        manager.restore()
    assert_states_equal(states, manager.restore(1).states)


def test_restore_of_a_step_with_a_corrupt_manifest_is_loud(manager, states):
    manager.save(1, states, blocking=True)
    (manager.root / step_dir_name(1) / MANIFEST_NAME).write_text("{}")
    with pytest.raises(ManifestError, match="restore of step 1"):
        manager.restore()


def test_restore_without_checkpoints_or_of_an_unknown_step(manager, states):
    with pytest.raises(IncompleteCheckpointError, match="no committed checkpoint"):
        manager.restore()
    manager.save(1, states)
    with pytest.raises(IncompleteCheckpointError, match=r"step 7 is not committed; committed steps: \[1\]"):
        manager.restore(7)


def test_missing_ok_is_none_only_when_nothing_is_committed(manager, states):
    assert manager.restore(missing_ok=True) is None
    manager.save(1, states, blocking=True)
    restored = manager.restore(missing_ok=True)
    assert restored is not None and restored.ranks == (0, 1, 2, 3)
    assert_states_equal(states, restored.states)
    with pytest.raises(UsageError, match="holds 4 ranks"):
        _ = restored.state  # one process per rank only
    flip_byte(manager.root / step_dir_name(1) / "rank-00001-of-00004.safetensors", 100)
    with pytest.raises(ChecksumMismatchError):
        manager.restore(missing_ok=True)  # a damaged step is not a fresh start


@pytest.mark.parametrize("damage", ["shard deleted", "shard cut short", "manifest damaged", "bucket only, object lost"])
def test_missing_ok_never_takes_a_damaged_or_partial_step_for_a_fresh_start(tmp_path, memory_url, states, damage):
    url, options = memory_url
    shard = f"{step_dir_name(1)}/rank-00002-of-00004.safetensors"
    with two_tier(tmp_path / "a", memory_url) as manager:
        assert manager.restore(missing_ok=True) is None
        manager.save(1, states)
        manager.wait(uploaded=True)
    local = tmp_path / "a" / shard
    if damage == "shard deleted":
        local.unlink()
        RemoteTier(url, options).backend.fs.rm(f"{url}/{shard}")
    elif damage == "shard cut short":
        os.truncate(local, local.stat().st_size - 1)
        RemoteTier(url, options).backend.fs.rm(f"{url}/{shard}")
    elif damage == "manifest damaged":
        (tmp_path / "a" / step_dir_name(1) / MANIFEST_NAME).write_text("{")
        RemoteTier(url, options).backend.fs.pipe(f"{url}/{step_dir_name(1)}/{MANIFEST_NAME}", b"{")
    else:  # a new node: an empty disk, and the bucket lost one object of the step
        RemoteTier(url, options).backend.fs.rm(f"{url}/{shard}")
    with two_tier(tmp_path / ("a" if damage != "bucket only, object lost" else "b"), memory_url) as manager:
        with pytest.raises((IncompleteCheckpointError, ManifestError)):
            manager.restore(missing_ok=True)


def test_one_rank_saves_a_plain_dict_and_restores_it_as_state(tmp_path, states):
    with CheckpointManager(tmp_path, world_size=1, runtime=ZERO1) as manager:
        manager.save(1, states[0], blocking=True)
        assert_states_equal([states[0]], [manager.restore().state])


def test_fast_verify_restores_and_still_catches_a_flipped_byte(manager, states):
    manager.save(1, states, blocking=True)
    assert_states_equal(states, manager.restore(verify="fast").states)
    flip_byte(manager.root / step_dir_name(1) / "rank-00000-of-00004.safetensors", 300)
    with pytest.raises(ChecksumMismatchError, match="xxh3_64"):
        manager.restore(verify="fast")


def test_restore_into_the_callers_buffers(manager, states):
    manager.save(1, states, blocking=True)
    buffers = [{key: np.zeros_like(array) for key, array in state.items()} for state in states]
    manager.restore(into=buffers)
    assert_states_equal(states, buffers)


def test_other_world_size_needs_an_explicit_reshard(manager, states):
    manager.save(1, states, blocking=True)
    with pytest.raises(WorldSizeMismatchError, match="saved by 4 ranks, but 2 are loading"):
        manager.restore(world_size=2)
    resharded = manager.restore(world_size=2, reshard=True)
    assert len(resharded.states) == 2
    assert_states_equal(zero1_states(world_size=2), resharded.states)


# --- background failures -------------------------------------------------------------------


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 8 MiB tmpfs, so a large save fails with ENOSPC (mounting needs root)."""
    if not running_as_root():
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)], check=True)
    yield mount_point
    subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


def test_full_disk_surfaces_once_on_the_next_call_and_keeps_earlier_steps(small_filesystem):
    states = large_states(4, 256 * 1024, version=1)
    manager = CheckpointManager(small_filesystem, world_size=4)
    manager.save(1, states, blocking=True)
    manager.save(2, large_states(4, 4 * 1024 * 1024))  # 16 MiB into 8 MiB: fails in the background
    with pytest.raises(SaveError, match="background save of step 2") as caught:
        manager.save(3, states)
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    assert caught.value.step == 2
    manager.wait()  # raised once: not again
    assert manager.steps() == [1]
    assert sorted(os.listdir(small_filesystem)) == [step_dir_name(1)]  # the failed step's files are freed
    assert_states_equal(states, manager.restore().states)
    manager.save(3, states, blocking=True)
    manager.close()


def test_background_error_is_raised_by_wait_then_close_raises_nothing(small_filesystem, states):
    manager = CheckpointManager(small_filesystem, world_size=4)
    manager.save(1, large_states(4, 4 * 1024 * 1024))
    with pytest.raises(SaveError) as caught:
        manager.wait()
    assert caught.value.__cause__ is not None
    manager.close()


def test_background_error_not_yet_raised_is_raised_by_close(small_filesystem):
    manager = CheckpointManager(small_filesystem, world_size=4)
    manager.save(1, large_states(4, 4 * 1024 * 1024))
    with pytest.raises(SaveError):
        manager.close()


def test_error_seen_through_the_handle_is_not_raised_again(small_filesystem):
    manager = CheckpointManager(small_filesystem, world_size=4)
    handle = manager.save(1, large_states(4, 4 * 1024 * 1024))
    with pytest.raises(SaveError):
        handle.committed.result()
    assert isinstance(handle.committed.exception(), SaveError)  # no manifest: the step is not committed
    manager.close()


def test_read_only_directory_fails_the_background_save(tmp_path, states):
    if not running_as_root() or shutil.which("chattr") is None:
        pytest.skip("making a directory immutable for root needs chattr and root")
    manager = CheckpointManager(tmp_path, world_size=4, runtime=ZERO1)
    manager.save(1, states, blocking=True)
    subprocess.run(["chattr", "+i", str(tmp_path)], check=True)
    try:
        manager.save(2, states)
        with pytest.raises(SaveError, match="step 2") as caught:
            manager.wait()
        assert isinstance(caught.value.__cause__, PermissionError)
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path)], check=True)
    assert manager.steps() == [1]
    assert_states_equal(states, manager.restore().states)
    manager.close()


# --- a real crash in the middle of an async save ------------------------------------------


@pytest.mark.slow
def test_sigkill_during_background_write_then_restart_restores_previous_step(tmp_path):
    kill_child_at(tmp_path, f"shard-bytes:{BYTES_PER_RANK}", "manager")
    assert (tmp_path / step_dir_name(2)).exists()  # the killed step's partial files
    with CheckpointManager(tmp_path, world_size=4) as manager:
        assert manager.steps() == [1]
        assert not (tmp_path / step_dir_name(2)).exists()
        result = manager.restore()
        assert result.step == 1
        assert_states_equal(large_states(4, BYTES_PER_RANK, version=1), result.states)


# --- the remote tier ---------------------------------------------------------------------


def two_tier(local, remote, *, upload=None, runtime=ZERO1, **remote_fields) -> CheckpointManager:
    """Four ranks over ``local`` (a path or LocalOptions) and the bucket ``remote`` (url, storage
    options); ``remote_fields`` are further RemoteOptions fields; uploads back off 10 ms by default."""
    url, options = remote
    return CheckpointManager(
        local,
        remote=RemoteOptions(url, storage_options=options, **remote_fields),
        upload=upload if upload is not None else UploadOptions(backoff_seconds=0.01),
        runtime=runtime,
        world_size=4,
    )


@pytest.mark.parametrize("layout", ["flat", "hashed"])
@pytest.mark.parametrize("remote_url", with_slow(REMOTES, "s3"), indirect=True)
def test_both_object_layouts_restore_and_rotate(tmp_path, remote_url, layout):
    import re

    url, options = remote_url
    with two_tier(tmp_path / "a", remote_url, layout=layout, keep_last=1) as manager:
        for step in (1, 2):
            manager.save(step, zero1_states(seed=step))
        manager.wait(uploaded=True)
    tier = RemoteTier(url, options)  # a reader with the default layout ("auto": flat at 4 ranks)
    remote = tier.read_manifest(2)
    names = [tier.object_name(2, record.path) for record in remote.manifest.shards]
    if layout == "hashed":  # recorded in the remote manifest, so any reader finds them
        assert all(re.fullmatch(r"[0-9a-f]{2}/rank-0000[0-3]-of-00004\.safetensors", name) for name in names)
        assert len(set(name[:2] for name in names)) > 1 and remote.locations
    else:
        assert names == [record.path for record in remote.manifest.shards] and not remote.locations
    objects = [path for path in tier.backend.fs.find(tier.backend.root) if "/rank-" in path]
    assert len(objects) == 4 and all(step_dir_name(2) in path for path in objects)  # step 1 rotated out whole
    with two_tier(tmp_path / "b", remote_url) as fresh:  # an empty disk, the default layout configured
        result = fresh.restore()
    assert result.step == 2 and set(result.sources.values()) == {"remote"}
    assert_states_equal(zero1_states(seed=2), result.states)


@pytest.mark.parametrize("world_size, hashed", [(4, False), (HASHED_FROM_RANKS - 1, False), (HASHED_FROM_RANKS, True)])
def test_the_auto_layout_hashes_the_objects_of_a_step_of_many_ranks(world_size, hashed):
    tier = RemoteTier(f"memory://auto-{world_size}")
    assert tier.layout == RemoteOptions("memory://x").layout == "auto"  # the default
    names = {tier.object_name(7, shard_name(rank, world_size)) for rank in range(world_size)}
    plain = {shard_name(rank, world_size) for rank in range(world_size)}
    if hashed:
        assert {name.partition("/")[2] for name in names} == plain and len({name[:3] for name in names}) > 1
        assert names == {RemoteTier("memory://h", layout="hashed").object_name(7, name) for name in plain}
    else:
        assert names == plain
    assert tier.object_name(7, "some-other-file.bin") == "some-other-file.bin"  # no world size: flat


def test_lost_local_directory_restores_entirely_from_the_bucket(tmp_path, remote_url, states):
    with two_tier(tmp_path / "node-a", remote_url) as manager:
        manager.save(1, zero1_states(seed=1))
        manager.save(2, states)
        manager.wait(uploaded=True)
        assert manager.remote_steps() == [1, 2]
        assert (manager.root / step_dir_name(2) / RECEIPT_NAME).exists()
    with two_tier(tmp_path / "node-b", remote_url) as fresh:  # a replaced node: empty local disk
        assert fresh.steps() == [] and fresh.latest_step() == 2
        result = fresh.restore()
        assert result.step == 2 and set(result.sources.values()) == {"remote"}
        assert_states_equal(states, result.states)
        assert fresh.steps() == [2]  # the local tier was refilled
        assert set(fresh.restore().sources.values()) == {"local"}


def test_damaged_local_shard_alone_comes_from_the_bucket(tmp_path, remote_url, states):
    with two_tier(tmp_path, remote_url) as manager:
        manager.save(1, states)
        manager.wait(uploaded=True)
        path = tmp_path / step_dir_name(1) / "rank-00002-of-00004.safetensors"
        flip_byte(path, 500)
        result = manager.restore()
        assert result.sources == {0: "local", 1: "local", 2: "remote", 3: "local"}
        assert_states_equal(states, result.states)
        assert manager.restore().sources[2] == "local"  # the local copy was repaired


@pytest.mark.parametrize("cloud_url", with_slow(CLOUDS, "s3"), indirect=True)
def test_damaged_local_and_remote_copies_fail_naming_both(tmp_path, cloud_url, states):
    url, options = cloud_url
    with two_tier(tmp_path, cloud_url) as manager:
        manager.save(1, states)
        manager.wait(uploaded=True)
        name = "rank-00001-of-00004.safetensors"
        local = tmp_path / step_dir_name(1) / name
        flip_byte(local, 700)
        remote_tier = RemoteTier(url, options)
        remote_path = f"{remote_tier.backend.root}/{step_dir_name(1)}/{name}"
        data = bytearray(remote_tier.backend.fs.cat_file(remote_path))
        data[700] ^= 0xFF
        remote_tier.backend.fs.pipe_file(remote_path, bytes(data))
        with pytest.raises(ChecksumMismatchError, match="restore of step 1: rank 1: no copy verifies") as caught:
            manager.restore()
        message = str(caught.value)
        assert str(local) in message and remote_tier.location(1, name) in message


def test_remote_retention_keeps_the_newest_remote_steps(tmp_path, memory_url):
    with two_tier(LocalOptions(tmp_path, keep_last=1), memory_url, keep_last=2, keep_every=10) as manager:
        for step in (5, 10, 15, 20, 25):
            manager.save(step, zero1_states(seed=step))
            manager.wait(uploaded=True)
        assert manager.remote_steps() == [10, 20, 25]
        assert manager.steps() == [25]


def test_each_tier_keeps_its_best_steps_by_the_metric_the_saves_recorded(tmp_path, s3_url):
    url, _options = s3_url
    local = LocalOptions(tmp_path, keep_last=1, keep_best=1, best_metric="loss")
    accuracies = {1: 0.5, 2: 0.9, 3: 0.7, 4: 0.8, 5: 0.6}
    with two_tier(local, s3_url, keep_last=1, keep_best=2, best_metric="acc", best_mode="max") as manager:
        for step, acc in accuracies.items():
            manager.save(step, zero1_states(seed=step), metrics={"acc": acc, "loss": 1 - acc})
            manager.wait(uploaded=True)
        assert manager.steps() == [2, 5]  # the lowest loss, and the newest
        assert manager.remote_steps() == [2, 4, 5]  # the two highest accuracies, and the newest
        assert RemoteTier(*s3_url).manifest(4).metrics == (("acc", 0.8), ("loss", pytest.approx(0.2)))
        assert_states_equal(zero1_states(seed=4), manager.restore(4).states)  # from the bucket
    assert url.startswith("s3://")


def test_a_step_whose_manifest_is_damaged_is_ranked_without_metrics(tmp_path, caplog):
    options = LocalOptions(tmp_path, keep_last=1, keep_best=1, best_metric="loss")
    with CheckpointManager(LocalOptions(tmp_path, keep_last=None), world_size=4, runtime=ZERO1) as manager:
        for step, loss in ((1, 0.05), (2, 0.1), (3, 0.4)):
            manager.save(step, zero1_states(seed=step), metrics={"loss": loss})
    (tmp_path / step_dir_name(1) / "manifest.json").write_text("{not json")  # flipped on disk: never readable
    with CheckpointManager(options, world_size=4, runtime=ZERO1) as manager, caplog.at_level(logging.WARNING):
        manager.save(4, zero1_states(seed=4), metrics={"loss": 0.3})
        manager.wait()
        assert manager.steps() == [2, 4]  # 2 the best readable, 4 the newest; 1 weighed as a step without metrics
    assert "ranks step 1 without metrics" in caplog.text


@pytest.mark.parametrize("cloud_url", with_slow(CLOUDS, "s3"), indirect=True)
def test_permanent_upload_failure_is_raised_and_local_steps_are_kept(tmp_path, cloud_url, states):
    url, options = cloud_url
    with two_tier(LocalOptions(tmp_path, keep_last=1), cloud_url) as manager:
        manager.save(1, states)
        manager.wait(uploaded=True)
        tier = RemoteTier(url, options)
        bucket = tier.backend.root.split("/")[0]
        tier.backend.fs.rm(bucket, recursive=True)  # the bucket is removed under the running job
        tier.backend.fs.invalidate_cache()
        assert not tier.backend.fs.exists(bucket)
        manager.save(2, zero1_states(seed=2))
        manager.save(3, zero1_states(seed=3))
        with pytest.raises(UploadError, match="upload of step 2 failed") as caught:
            manager.wait(uploaded=True)
        assert caught.value.step == 2 and caught.value.tries == 1
        assert isinstance(caught.value.__cause__, RemoteError) and not caught.value.__cause__.transient
        with pytest.raises(UploadError, match="step 3"):
            manager.wait(uploaded=True)
        assert manager.steps() == [2, 3]  # keep_last=1, but steps 2 and 3 never reached the bucket
        assert_states_equal(zero1_states(seed=3), manager.restore(3).states)


class BlockedUploads:
    """Holds every shard upload until released (test instrumentation of a slow bucket)."""

    def __init__(self, monkeypatch):
        self.started = threading.Event()  # set once the uploader holds a step
        self.release = threading.Event()
        original = RemoteTier.land_shard

        def land_shard(tier, step, record, source, **options):
            self.started.set()
            self.release.wait()
            return original(tier, step, record, source, **options)

        monkeypatch.setattr(RemoteTier, "land_shard", land_shard)


def test_uploads_behind_with_skip_upload_only_the_newest(tmp_path, memory_url, monkeypatch):
    blocked = BlockedUploads(monkeypatch)
    manager = two_tier(
        LocalOptions(tmp_path, keep_last=1),
        memory_url,
        upload=UploadOptions(backoff_seconds=0.01, max_pending=1, when_behind="skip"),
    )
    handles = {1: manager.save(1, zero1_states(seed=1), blocking=True)}
    blocked.started.wait()  # step 1 is being uploaded, out of the queue
    for step in (2, 3):  # 2 waits in the queue, 3 pushes it out
        handles[step] = manager.save(step, zero1_states(seed=step), blocking=True)
    skipped = handles[2].uploaded.exception(timeout=60)  # settled when step 3 took its place
    assert isinstance(skipped, UploadError) and skipped.step == 2 and skipped.transient
    assert "stays local-only" in str(skipped) and "superseded by step 3" in str(skipped)
    blocked.release.set()
    manager.wait(uploaded=True)
    assert handles[1].uploaded.result() is None and handles[3].uploaded.result() is None
    assert manager.remote_steps() == [1, 3]
    assert manager.steps() == [3]  # step 2 was superseded by step 3's remote commit
    manager.close()


def test_a_bucket_that_is_down_does_not_fill_the_disk(tmp_path, memory_url, monkeypatch, caplog):
    def unreachable(tier, step, record, source, **options):
        raise RemoteError("the bucket is unreachable", transient=False)

    with monkeypatch.context() as down:
        down.setattr(RemoteTier, "land_shard", unreachable)
        with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
            manager = two_tier(LocalOptions(tmp_path, keep_last=1, max_awaiting_upload=2), memory_url)
            for step in range(1, 7):
                manager.save(step, zero1_states(seed=step), blocking=True)
                with pytest.raises(UploadError, match=f"step {step}"):
                    manager.wait(uploaded=True)
            manager.wait()
        assert manager.steps() == [5, 6]  # the newest two waiting steps; never the newest
        assert manager.lag().steps_behind == 2
        assert any("deleted step 1" in r.getMessage() and "before it reached" in r.getMessage() for r in caplog.records)
    manager.save(7, zero1_states(seed=7), blocking=True)  # the bucket is back
    manager.wait(uploaded=True)
    assert manager.remote_steps() == [7] and manager.steps() == [7]
    manager.close()


def until(condition, what, guard_seconds=120.0):
    """Wait for ``condition()`` to hold (a guard against a hang, not a timing assertion)."""
    import time

    give_up = time.monotonic() + guard_seconds
    while not condition():
        assert time.monotonic() < give_up, f"never: {what}"
        time.sleep(0.02)


def outage_options(**fields):
    """Small backoffs so that a test's bucket outage costs little time."""

    return UploadOptions(**{"max_tries": 2, "backoff_seconds": 0.01, "max_backoff_seconds": 0.2, **fields})


@pytest.mark.slow
def test_a_bucket_outage_never_fails_save_wait_or_close_and_every_step_saved_since_commits_once_back(
    tmp_path, stoppable_s3, caplog
):
    server, url, options = stoppable_s3
    caplog.set_level(logging.WARNING, logger="tiered_ckpt")
    local = LocalOptions(tmp_path, keep_last=2, max_awaiting_upload=10)
    with two_tier(local, (url, options), upload=outage_options()) as manager:
        manager.save(1, zero1_states(seed=1))
        manager.wait(uploaded=True)
        server.stop()  # connection refused from now on
        for step in range(2, 7):
            manager.save(step, zero1_states(seed=step), blocking=True)  # never raises, never blocks for long

        def tries() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.getMessage().startswith("upload of step 2 failed (try")]

        # the lag shows a retry as it starts, its WARNING follows: wait for both, whatever the load
        until(lambda: manager.lag().retrying_step == 2 and len(tries()) >= 2, "retried twice, and logged")
        lag = manager.lag()
        assert lag.retry_tries >= 2 and lag.newest_remote == 1 and [step for step, _ in lag.waiting] == [2, 3, 4, 5, 6]
        assert "upload of step 2" in lag.last_error and "Connect" in lag.last_error and lag.last_error_at > 0
        manager.wait()  # the local commits are all there; the bucket is no error of wait()
        assert all(r.levelno == logging.WARNING for r in tries())
        assert all(options["secret"] not in r.getMessage() for r in caplog.records)
        server.start()  # the bucket is back, on the same port
        manager.wait(uploaded=True)
        assert manager.remote_steps() == [1, 2, 3, 4, 5, 6]  # every step saved during the outage
        assert manager.lag().retrying_step is None and manager.steps() == [5, 6]


def hung_bucket_options(**fields):
    """Requests cut short after 0.5 s without an answer, and tried again for as long as a test's
    hang lasts: only the per-request timeout tells a hung bucket from a slow one."""
    return UploadOptions(
        **{"timeout_seconds": 0.5, "max_tries": 10_000, "max_seconds": 3600, "backoff_seconds": 0.01,
           "max_backoff_seconds": 0.1, **fields}
    )  # fmt: skip


@pytest.mark.slow
def test_a_bucket_that_accepts_and_never_answers_blocks_no_save_and_every_step_arrives_once_it_answers(
    tmp_path, moto_endpoint, s3_url, caplog
):
    from support.stores import FaultInjectingProxy, s3_storage_options

    url, _options = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=0.0)
    caplog.set_level(logging.WARNING, logger="tiered_ckpt")
    local = LocalOptions(tmp_path, keep_last=2, max_awaiting_upload=10)
    remote = (url, s3_storage_options(proxy.endpoint))
    try:
        with two_tier(local, remote, upload=hung_bucket_options()) as manager:
            manager.save(1, zero1_states(seed=1))
            manager.wait(uploaded=True)
            proxy.stall = ("GET", "PUT", "POST", "HEAD", "DELETE")  # accepted, read, never answered
            try:
                saved = threading.Thread(
                    target=lambda: [manager.save(s, zero1_states(seed=s), blocking=True) for s in range(2, 8)]
                )
                saved.start()
                saved.join(timeout=60)  # a guard against a hang: the bucket stays hung all along
                assert not saved.is_alive(), "a save waited for the hung bucket"
                until(lambda: manager.lag().retrying_step == 2, "step 2 shown retrying while the bucket hangs")
                lag = manager.lag()
                assert lag.retry_tries >= 1 and "Timeout" in lag.last_error and lag.newest_remote == 1
                assert [step for step, _ in lag.waiting] == list(range(2, 8)) and manager.steps() == list(range(2, 8))
                hung = [r.getMessage() for r in caplog.records if "transient error (try" in r.getMessage()]
                assert any("Timeout" in message for message in hung)
            finally:
                proxy.stall = ()  # the bucket answers again
                saved.join()
            manager.wait(uploaded=True)
            assert manager.remote_steps() == list(range(1, 8))  # every step saved during the hang
            assert manager.lag().retrying_step is None
    finally:
        proxy.close()


@pytest.mark.slow
def test_a_manager_starts_while_its_bucket_hangs_restores_from_its_disk_and_sets_the_bucket_up_once_it_answers(
    tmp_path, moto_endpoint, s3_url, caplog
):
    from support.stores import FaultInjectingProxy, s3_storage_options

    url, _options = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=0.0)
    remote = (url, s3_storage_options(proxy.endpoint))
    caplog.set_level(logging.WARNING, logger="tiered_ckpt")
    try:
        with two_tier(tmp_path / "node", remote, upload=hung_bucket_options()) as manager:
            for step in (1, 2):
                manager.save(step, zero1_states(seed=step))
            manager.wait(uploaded=True)
        proxy.stall = ("GET", "PUT", "POST", "HEAD", "DELETE")  # a restart while the bucket hangs
        try:
            with two_tier(tmp_path / "node", remote, upload=hung_bucket_options(max_tries=3)) as manager:
                assert any("did not answer at start-up" in r.getMessage() for r in caplog.records)
                restored = manager.restore()  # every step it needs is on its disk
                assert restored.step == 2 and set(restored.sources.values()) == {"local"}
                assert_states_equal(zero1_states(seed=2), restored.states)
                manager.save(3, zero1_states(seed=3), blocking=True)
                failing = "the bucket is failing"
                until(lambda: failing in (manager.lag().last_error or ""), "the setup tried in the background")
                with two_tier(tmp_path / "fresh", remote, upload=hung_bucket_options(max_tries=3)) as fresh:
                    with pytest.raises(RemoteError, match=f"restore: the bucket {url} does not answer") as caught:
                        fresh.restore()  # no disk of this job can serve it: a typed, transient error
                    assert caught.value.transient
                proxy.stall = ()  # the bucket answers again: set up, and step 3 uploaded
                manager.wait(uploaded=True)
                assert manager.remote_steps() == [1, 2, 3]
        finally:
            proxy.stall = ()
    finally:
        proxy.close()
    with pytest.raises(RemoteError, match="does not exist") as caught:  # a permanent failure: refused at once
        two_tier(tmp_path / "other", ("s3://tiered-no-such-bucket/run", s3_storage_options(moto_endpoint)))
    assert not caught.value.transient


@pytest.mark.slow
def test_an_outage_keeps_at_most_max_awaiting_upload_waiting_steps_beside_the_one_being_retried(
    tmp_path, stoppable_s3, caplog
):
    server, url, options = stoppable_s3
    caplog.set_level(logging.WARNING, logger="tiered_ckpt")
    upload = outage_options(max_pending=1)
    with two_tier(LocalOptions(tmp_path, keep_last=1, max_awaiting_upload=2), (url, options), upload=upload) as manager:
        server.stop()
        manager.save(1, zero1_states(seed=1), blocking=True)
        until(lambda: manager.lag().retrying_step == 1, "step 1's upload is retried")
        for step in range(2, 7):
            manager.save(step, zero1_states(seed=step), blocking=True)  # never waits for the bucket
        manager.wait()
        assert manager.steps() == [1, 5, 6]  # the step being retried and the newest two waiting ones
        assert any("deleted step 2" in r.getMessage() and "before it reached" in r.getMessage() for r in caplog.records)
        server.start()
        manager.wait(uploaded=True)
        assert manager.remote_steps() == [1, 5, 6] and manager.steps() == [6]


@pytest.mark.slow
def test_a_step_that_missed_its_deadline_in_an_outage_fails_only_wait_uploaded_and_stays_local(
    tmp_path, stoppable_s3, caplog
):
    server, url, options = stoppable_s3
    # Uploads that must succeed run under a deadline none can miss (however loaded the
    # machine is); the 1 s deadlines are missed for certain, the bucket being down.
    with two_tier(tmp_path, (url, options), upload=outage_options()) as manager:
        manager.save(1, zero1_states(seed=1))
        manager.wait(uploaded=True)
    with two_tier(tmp_path, (url, options), upload=outage_options(deadline_seconds=1)) as manager:
        server.stop()
        manager.save(2, zero1_states(seed=2))
        until(lambda: "within its deadline" in (manager.lag().last_error or ""), "step 2 missed its deadline")
        manager.save(3, zero1_states(seed=3), blocking=True)  # a missed deadline is no error of save
        manager.wait()
        with pytest.raises(UploadError, match="steps 2, 3 missed their upload deadline") as caught:
            manager.wait(uploaded=True)
        assert caught.value.transient and caught.value.step == 3
        cause = caught.value.__cause__  # the outage, or the deadline cutting the last try short
        assert isinstance(cause, RemoteError) and (cause.transient or cause.deadline)
        manager.wait(uploaded=True)  # each missed step is reported once
        assert manager.steps() == [1, 2, 3]  # on local disk, whatever the bucket
    server.start()
    # Back online: the next manager on the directory uploads what missed its deadline, then the new step.
    with two_tier(tmp_path, (url, options), upload=outage_options()) as manager:
        manager.save(4, zero1_states(seed=4))
        manager.wait(uploaded=True)
        assert manager.remote_steps() == [1, 2, 3, 4]
    with two_tier(tmp_path, (url, options), upload=outage_options(deadline_seconds=1)) as manager:
        server.stop()
        manager.save(5, zero1_states(seed=5))
        with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
            manager.close()  # waits for step 5's deadline, logs it, does not raise
        assert any("step 5 is on local disk only" in r.getMessage() for r in caplog.records)
    server.start()
    with two_tier(tmp_path, (url, options), upload=outage_options()) as again:
        again.wait(uploaded=True)  # the next manager on the directory uploads it
        assert again.remote_steps() == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_leaving_the_with_block_on_an_error_does_not_wait_for_a_failing_bucket(tmp_path, stoppable_s3, caplog):
    import time

    server, url, options = stoppable_s3
    caplog.set_level(logging.WARNING, logger="tiered_ckpt")
    with pytest.raises(RuntimeError, match="the training loop failed"):
        with two_tier(tmp_path, (url, options), upload=outage_options(deadline_seconds=3600)) as manager:
            manager.save(1, zero1_states(seed=1))
            manager.wait(uploaded=True)
            server.stop()
            manager.save(2, zero1_states(seed=2), blocking=True)
            until(lambda: manager.lag().retrying_step == 2, "step 2's upload is retried")
            left = time.monotonic()
            raise RuntimeError("the training loop failed")
    assert time.monotonic() - left < 120  # a guard: not the hour of step 2's deadline
    assert any("step 2 is on local disk only" in r.getMessage() for r in caplog.records)
    server.start()
    with two_tier(tmp_path, (url, options)) as again:
        again.wait(uploaded=True)  # the next run uploads it
        assert again.remote_steps() == [1, 2]


def test_a_permanent_upload_failure_is_raised_by_the_next_save_saying_its_step_was_not_saved(tmp_path, s3_url):
    url, options = s3_url
    manager = two_tier(tmp_path, s3_url)
    manager.save(1, zero1_states(seed=1))
    manager.wait(uploaded=True)
    tier = RemoteTier(url, options)
    tier.backend.fs.rm(tier.backend.root.split("/")[0], recursive=True)  # no such bucket: permanent
    manager.save(2, zero1_states(seed=2), blocking=True)
    until(lambda: manager.lag().last_error is not None, "the upload of step 2 failed")
    with pytest.raises(UploadError, match="upload of step 2 failed.*so step 3 was not saved") as caught:
        manager.save(3, zero1_states(seed=3))
    assert caught.value.step == 2 and not caught.value.transient
    assert isinstance(caught.value.__cause__, RemoteError) and not caught.value.__cause__.transient
    assert manager.steps() == [1, 2]
    manager.save(3, zero1_states(seed=3), blocking=True)  # raised once: the next save goes on
    with pytest.raises(UploadError, match="upload of step 3 failed after 1 try"):
        manager.close()  # a permanent failure is raised by close too


def test_the_handles_futures_and_check_for_errors_raise_a_failed_upload_once(tmp_path, s3_url):
    url, options = s3_url
    manager = two_tier(tmp_path, s3_url)
    first = manager.save(1, zero1_states(seed=1))
    assert first.uploaded.result() is None and first.committed.result().step == 1
    manager.check_for_errors()  # nothing failed
    tier = RemoteTier(url, options)
    tier.backend.fs.rm(tier.backend.root.split("/")[0], recursive=True)  # no such bucket: permanent
    second = manager.save(2, zero1_states(seed=2), blocking=True)
    assert second.committed.result().step == 2  # on local disk whatever the bucket
    with pytest.raises(UploadError, match="upload of step 2 failed") as caught:
        second.uploaded.result()
    assert caught.value.step == 2 and not caught.value.transient
    manager.check_for_errors()  # raised by the handle's future already: not again
    third = manager.save(3, zero1_states(seed=3), blocking=True)  # nor by save
    assert isinstance(third.uploaded.exception(timeout=60), UploadError)
    with pytest.raises(UploadError, match="upload of step 3 failed"):
        manager.check_for_errors()
    manager.check_for_errors()  # once
    manager.close()  # nothing left to raise
    assert manager.steps() == [1, 2, 3]


def test_uploads_behind_with_wait_hold_no_save_and_upload_every_step_in_order(tmp_path, memory_url, monkeypatch):
    blocked = BlockedUploads(monkeypatch)
    manager = two_tier(
        tmp_path, memory_url, upload=UploadOptions(backoff_seconds=0.01, max_pending=1, when_behind="wait")
    )
    manager.save(1, zero1_states(seed=1), blocking=True)
    blocked.started.wait()  # step 1 is being uploaded (held: no answer yet)
    for step in (2, 3, 4):  # beyond max_pending: each committed locally while the upload is still held
        assert manager.save(step, zero1_states(seed=step), blocking=True).committed.result().step == step
    assert manager.lag().steps_behind == 4
    blocked.release.set()
    manager.wait(uploaded=True)
    assert manager.remote_steps() == [1, 2, 3, 4]  # none skipped within local.max_awaiting_upload
    manager.close()


def test_credentials_never_appear_in_logs_errors_or_reprs(tmp_path, s3_url, moto_endpoint, caplog, states):
    url, options = s3_url
    secret, key = options["secret"], options["key"]
    caplog.set_level(logging.DEBUG)
    seen = []
    with two_tier(tmp_path / "a", s3_url) as manager:
        manager.save(1, states)
        manager.wait(uploaded=True)
        seen += [repr(manager), repr(manager.store), repr(manager.store.remote), repr(manager._parts.uploader)]
    broken = ("s3://tiered-no-such-bucket/run", options)
    with pytest.raises(RemoteError, match="does not exist") as caught:  # refused at construction
        with two_tier(tmp_path / "b", broken) as manager:
            manager.save(1, states)
    error = caught.value
    while error is not None:
        seen.append(str(error))
        seen.append(repr(error))
        error = error.__cause__
    ours = [record for record in caplog.records if record.name.startswith("tiered_ckpt")]
    assert ours  # the library did log: commits, and the failure
    seen += [record.getMessage() for record in ours] + [record.exc_text or "" for record in ours]
    assert not [text for text in seen if secret in text or key in text]
    # botocore's own DEBUG log carries the key id inside request signatures, never the secret
    assert not [record for record in caplog.records if secret in record.getMessage()]


@pytest.mark.slow
def test_a_multipart_upload_killed_midway_is_aborted_by_the_next_start(tmp_path, s3_url, caplog):
    import json

    url, options = s3_url
    kill_child_at(tmp_path, "multipart", json.dumps({"url": url, "options": options}), bytes_per_rank=12 << 20)
    tier = RemoteTier(url, options)
    bucket, prefix, _version = tier.backend.fs.split_path(tier.backend.root)
    open_uploads = tier.backend.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    assert [upload["Key"].rsplit("/", 1)[-1] for upload in open_uploads] == ["rank-00000-of-00004.safetensors"]
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        with CheckpointManager(tmp_path, world_size=4, remote=RemoteOptions(url, storage_options=options)) as manager:
            manager.wait(uploaded=True)  # the killed step's upload, resumed and completed
            assert manager.remote_steps() == [1]
    assert "Uploads" not in tier.backend.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    assert any("aborted an unfinished multipart upload" in record.getMessage() for record in caplog.records)


@pytest.mark.slow
def test_sigkill_during_upload_then_restart_completes_it_without_resending(tmp_path, cloud_url, monkeypatch):
    import json

    url, options = cloud_url
    bytes_per_rank = 2 * 1024 * 1024
    kill_child_at(tmp_path, "upload", json.dumps({"url": url, "options": options}), bytes_per_rank=bytes_per_rank)
    remote = RemoteTier(url, options)
    assert remote.steps() == [1] and remote.uncommitted_steps() == [2]  # half-uploaded, invisible

    uploads = []
    original = Counting.put_shard  # the PUT itself, made only for a shard not already in the bucket intact

    def counting_upload(backend, local_path, path, record, **options):
        uploads.append((parse_step_dir_name(PurePosixPath(path).parent.name), record.rank))
        return original(backend, local_path, path, record, **options)

    monkeypatch.setattr(Counting, "put_shard", counting_upload)
    with CheckpointManager(tmp_path, world_size=4, remote=RemoteOptions(url, storage_options=options)) as manager:
        manager.wait(uploaded=True)
        assert manager.remote_steps() == [1, 2]
    assert sorted(uploads) == [(2, 1), (2, 2), (2, 3)]  # rank 0 was uploaded intact before the kill
    for step in remote.steps():
        assert all(remote.check_shard(step, record) is None for record in remote.read_manifest(step).manifest.shards)
    with CheckpointManager(
        tmp_path / "fresh-node", world_size=4, remote=RemoteOptions(url, storage_options=options)
    ) as fresh:
        result = fresh.restore()
    assert result.step == 2 and set(result.sources.values()) == {"remote"}
    assert_states_equal(large_states(4, bytes_per_rank, version=2), result.states)


@pytest.mark.slow
def test_transient_faults_on_30_percent_of_requests_still_commit_every_step(tmp_path, faulty_s3, s3_url, caplog):
    proxy, url, options = faulty_s3
    caplog.set_level(logging.WARNING, logger="tiered_ckpt")
    with CheckpointManager(
        LocalOptions(tmp_path, keep_last=2),
        world_size=4,
        remote=RemoteOptions(url, storage_options=options),
        upload=UploadOptions(backoff_seconds=0.001, max_tries=25),  # 25 failures in a row: odds of 1 in 10**13
    ) as manager:
        for step in range(1, 6):
            manager.save(step, large_states(4, 256 * 1024, version=step))
        manager.wait(uploaded=True)
    assert proxy.requests > 100 and 0.2 < proxy.injected / proxy.requests < 0.4
    assert any("transient error" in record.getMessage() for record in caplog.records)
    direct_url, direct_options = s3_url
    with CheckpointManager(
        tmp_path / "other-node", world_size=4, remote=RemoteOptions(direct_url, storage_options=direct_options)
    ) as node:
        assert node.remote_steps() == [1, 2, 3, 4, 5]
        assert_states_equal(large_states(4, 256 * 1024, version=5), node.restore().states)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["gcs", "azure"])
def test_transient_faults_on_gcs_and_azure_still_commit_every_step(tmp_path, store, request):
    proxy, url, options = request.getfixturevalue(f"faulty_{store}")
    with CheckpointManager(
        tmp_path,
        world_size=2,
        remote=RemoteOptions(url, storage_options=options),
        upload=UploadOptions(backoff_seconds=0.001, max_tries=25),
    ) as manager:
        for step in (1, 2):
            manager.save(step, large_states(2, 64 * 1024, version=step))
        manager.wait(uploaded=True)
    assert proxy.injected >= 3 and proxy.requests > proxy.injected
    direct_url, direct_options = request.getfixturevalue(f"{store}_url")
    with CheckpointManager(
        tmp_path / "other-node", world_size=2, remote=RemoteOptions(direct_url, storage_options=direct_options)
    ) as node:
        assert node.remote_steps() == [1, 2]
        assert_states_equal(large_states(2, 64 * 1024, version=2), node.restore().states)


def test_a_failing_start_releases_the_directory_and_stops_the_uploader(tmp_path, memory_url, states):
    url, options = memory_url
    with CheckpointManager(tmp_path, world_size=4, runtime=ZERO1) as manager:
        manager.save(1, states)  # local only: no receipt
    tier = RemoteTier(url, options)
    tier.backend.fs.pipe_file(f"{tier.backend.root}/{step_dir_name(1)}/manifest.json", b"{not json")
    threads_before = {thread.name for thread in threading.enumerate()}
    with pytest.raises(ManifestError, match="not a valid JSON manifest"):
        CheckpointManager(tmp_path, world_size=4, remote=RemoteOptions(url, storage_options=options))
    assert not any(t.name.startswith("tiered-ckpt") for t in threading.enumerate() if t.name not in threads_before)
    CheckpointManager(tmp_path, world_size=4).close()  # the directory was released


@pytest.mark.slow
def test_a_store_that_always_refuses_costs_max_tries_requests_per_operation(tmp_path, moto_endpoint, s3_url, states):
    """The one retry policy, counted on the wire: botocore's and s3fs's own retries are switched
    off by the library itself (the test sets none), so a failing operation costs max_tries requests."""
    from support.stores import FaultInjectingProxy, s3_storage_options

    url, _ = s3_url
    everything = FaultInjectingProxy(moto_endpoint, failure_rate=1.0)
    remote = RemoteOptions(url, storage_options=s3_storage_options(everything.endpoint))
    tier = open_remote_tier(remote, UploadOptions(max_tries=3, backoff_seconds=0), check_bucket=False)
    with pytest.raises(RemoteError, match="listing") as caught:  # a listing of the bucket, as a restore makes
        tier.steps()
    everything.close()
    assert caught.value.tries == 3 and everything.requests == 3

    puts = FaultInjectingProxy(moto_endpoint, failure_rate=1.0, methods=("PUT",))
    with pytest.raises(UploadError, match="within its deadline") as caught:
        with CheckpointManager(
            tmp_path / "b",
            world_size=4,
            remote=RemoteOptions(url, storage_options=s3_storage_options(puts.endpoint)),
            upload=UploadOptions(max_tries=3, backoff_seconds=0, concurrency=1, deadline_seconds=1),
            runtime=ZERO1,
        ) as manager:
            manager.save(1, states)
            manager.wait(uploaded=True)
    puts.close()
    # The step is tried again as a whole until its deadline; each try of it costs at most
    # max_tries PUTs per shard (4 shards): tries never multiply.
    assert 3 <= puts.injected <= 4 * caught.value.tries


# --- hostile input and faults ------------------------------------------------------------


def test_a_typo_in_verify_is_refused_not_taken_as_fast(manager, states):
    manager.save(1, states, blocking=True)
    with pytest.raises(ConfigError, match="verify must be 'full'"):
        manager.restore(verify="Full")
    with pytest.raises(ValueError, match="verify must be one of"):
        CheckpointManager(manager.root / "other", world_size=4, restore=RestoreOptions(verify="sha256"))


@pytest.mark.parametrize(
    "arguments, problem",
    [
        ({"world_size": 0, "reshard": True}, "world_size must be an integer >= 1"),
        ({"step": 1.0}, "step must be None or an integer"),
        ({"step": True}, "step must be None or an integer"),
        ({"into": 5}, "into must be a dict of arrays or a list"),
    ],
)
def test_restore_arguments_it_cannot_take_are_usage_errors(manager, states, arguments, problem):
    manager.save(1, states, blocking=True)
    with pytest.raises(UsageError, match=problem):
        manager.restore(**arguments)


def test_a_bad_world_size_names_the_keyword_argument(tmp_path):
    with pytest.raises(ConfigError, match="^keyword argument world_size must be an integer >= 1, got 0$"):
        CheckpointManager(tmp_path / "ckpt", world_size=0)


@pytest.mark.parametrize("url", ["s3://", "gs://", "memory://", "", "s3:///"])
def test_a_remote_url_without_a_bucket_is_refused(tmp_path, url, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="names no bucket or directory"):
        CheckpointManager(tmp_path / "ckpt", world_size=1, remote=url)
    assert sorted(os.listdir(tmp_path)) == []  # nothing created, here or as a "s3:" directory


def test_a_masked_array_is_refused_before_anything_is_written(manager, states):
    bad = [dict(state) for state in states]
    bad[2]["mask"] = np.ma.masked_array([1.0, 2.0], mask=[False, True])
    with pytest.raises(InvalidStateError, match=r'rank 2: state\["mask"\] is a masked array'):
        manager.save(1, bad)
    assert os.listdir(manager.root) == []


def test_a_directory_replaced_under_a_running_manager_is_never_written(tmp_path, states):
    import shutil

    first = CheckpointManager(LocalOptions(tmp_path, keep_last=1), world_size=4, runtime=ZERO1)
    first.save(1, states, blocking=True)
    shutil.rmtree(tmp_path)  # the directory is deleted under the running job...
    with CheckpointManager(LocalOptions(tmp_path, keep_last=1), world_size=4, runtime=ZERO1) as second:
        second.save(5, states, blocking=True)  # ...and another job recreates and locks it
        with pytest.raises(DirectoryInUseError, match="removed or replaced since this job locked it"):
            first.save(6, states, blocking=True)
        with pytest.raises(DirectoryInUseError, match="removed or replaced"):
            first.restore()  # the checkpoints there are another job's now
        assert second.steps() == [5]
        assert_states_equal(states, second.restore().states)
    first.close()


def test_a_closed_port_is_a_typed_error_at_start(tmp_path):
    from support.stores import free_port

    with pytest.raises(RemoteError, match="cannot open ftp://127.0.0.1"):
        CheckpointManager(tmp_path, world_size=1, remote=f"ftp://127.0.0.1:{free_port()}/x")


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3", "gcs", "azure"])
def test_bytes_changed_in_transit_are_never_committed(tmp_path, store, request, monkeypatch, states, caplog):
    """A proxy flips a byte of every PUT/POST body: the checksum the store computed of what it
    received (S3's ETag, GCS's md5Hash, Azure's Content-MD5) differs from the file's, so no
    shard is confirmed."""
    from support.stores import FaultInjectingProxy

    endpoint = request.getfixturevalue({"s3": "moto_endpoint", "gcs": "gcs_endpoint"}.get(store, "azurite_endpoint"))
    url, options = request.getfixturevalue(f"{store}_url")
    account = endpoint.rsplit("/", 1)[1] if store == "azure" else ""
    proxy = FaultInjectingProxy(endpoint.removesuffix(f"/{account}"), failure_rate=0.0, corrupt=("PUT", "POST"))
    if store == "s3":
        from support.stores import s3_storage_options

        options = s3_storage_options(proxy.endpoint)
    elif store == "azure":
        options = {**options, "endpoint_url": f"{proxy.endpoint}/{account}"}
    else:
        import asyncio
        import types

        import gcsfs.retry

        async def no_sleep(_seconds):
            await asyncio.sleep(0)

        monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=no_sleep))
        options = {**options, "endpoint_url": proxy.endpoint}
    caplog.set_level(logging.WARNING, logger="tiered_ckpt")
    try:
        with pytest.raises(UploadError, match="within its deadline") as caught:
            with two_tier(
                tmp_path, (url, options), upload=UploadOptions(max_tries=2, backoff_seconds=0.01, deadline_seconds=3)
            ) as manager:
                manager.save(1, states)
                manager.wait(uploaded=True)
        assert caught.value.tries >= 2 and caught.value.transient  # tried again until the deadline
        # The deadline may cut the last try's request short; each finished try was refused so.
        tries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("upload of step 1 failed")]
        assert tries and all("not confirmed after the upload" in message for message in tries)
    finally:
        proxy.close()
    assert RemoteTier(*request.getfixturevalue(f"{store}_url")).steps() == []


@pytest.mark.slow
def test_lag_reports_the_lag_the_upload_rate_and_the_last_error(tmp_path, moto_endpoint, s3_url, states, caplog):
    from support.stores import FaultInjectingProxy, s3_storage_options

    url, _ = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=0.0)
    upload = UploadOptions(max_tries=1, backoff_seconds=0.01, max_backoff_seconds=0.05, deadline_seconds=1)
    try:
        with caplog.at_level(logging.INFO, logger="tiered_ckpt"), CheckpointManager(
            tmp_path, world_size=4, runtime=ZERO1,
            remote=RemoteOptions(url, storage_options=s3_storage_options(proxy.endpoint)), upload=upload,
        ) as manager:  # fmt: skip
            assert manager.lag().newest_remote is None and manager.lag().upload_bytes_per_second is None
            manager.save(1, states)
            manager.wait(uploaded=True)
            lag = manager.lag()
            assert (lag.newest_local, lag.newest_remote, lag.waiting, lag.last_error) == (1, 1, (), None)
            assert lag.upload_bytes_per_second > 0
            assert any("step 1 committed at" in r.getMessage() and "MB/s" in r.getMessage() for r in caplog.records)
            proxy.failure_rate = 1.0  # the bucket is down
            manager.save(2, states)
            with pytest.raises(UploadError, match="step 2 was not committed .* within its deadline"):
                manager.wait(uploaded=True)
            lag = manager.lag()
            assert (lag.newest_local, lag.newest_remote, lag.steps_behind) == (2, 1, 1)
            assert lag.waiting[0][0] == 2 and lag.waiting[0][1] == manager.store.local.manifest(2).total_bytes
            assert "step 2 was not committed" in lag.last_error and lag.last_error_at > 0
            proxy.failure_rate = 0.0
    finally:
        proxy.close()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["stall", "throttle"])
def test_a_step_not_committed_within_its_deadline_fails_and_the_next_step_goes_on(
    tmp_path, moto_endpoint, s3_url, states, fault
):
    from support.stores import FaultInjectingProxy, s3_storage_options

    url, _ = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=0.0)
    # Retry bounds far beyond the deadline: only the deadline can end the first step's upload.
    upload = UploadOptions(
        max_tries=10_000, backoff_seconds=0.05, max_seconds=3600, timeout_seconds=3600, deadline_seconds=2
    )
    try:
        with CheckpointManager(
            tmp_path, world_size=4, runtime=ZERO1,
            remote=RemoteOptions(url, storage_options=s3_storage_options(proxy.endpoint)), upload=upload,
        ) as manager:  # fmt: skip
            if fault == "stall":
                proxy.stall = ("PUT",)  # shards are sent and never answered
            else:
                proxy.failure_rate = 1.0  # every request: 503 SlowDown
            manager.save(1, states)
            with pytest.raises(UploadError, match="step 1 was not committed .* within its deadline of 2 s") as caught:
                manager.wait(uploaded=True)
            assert caught.value.step == 1 and isinstance(caught.value.__cause__, RemoteError)
            proxy.stall, proxy.failure_rate = (), 0.0
            manager.save(2, states)
            manager.wait(uploaded=True)
            assert manager.remote_steps() == [2]
            assert 1 in manager.steps()  # the step that missed its deadline stays on local disk
    finally:
        proxy.close()


@pytest.mark.slow
def test_a_bucket_throttling_half_the_requests_for_a_while_gets_every_step_within_a_request_bound(
    tmp_path, moto_endpoint, s3_url
):
    from support.states import large_states
    from support.stores import FaultInjectingProxy, s3_storage_options

    url, _ = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=0.0)
    # Parts of 5 MiB: each 12 MiB shard goes up as a multipart upload of 3 parts.
    upload = UploadOptions(max_tries=30, backoff_seconds=0.01, part_bytes=5 << 20, part_concurrency=8)
    counts = []
    try:
        with CheckpointManager(
            tmp_path,
            world_size=4,
            remote=RemoteOptions(url, storage_options=s3_storage_options(proxy.endpoint)),
            upload=upload,
        ) as manager:
            for step, rate in ((1, 0.0), (2, 0.5), (3, 0.0)):  # clean, throttled for a while, clean again
                proxy.failure_rate = rate
                before = proxy.requests
                manager.save(step, large_states(4, 12 << 20, version=step))
                manager.wait(uploaded=True)
                counts.append(proxy.requests - before)
            assert manager.remote_steps() == [1, 2, 3]
            assert (
                manager.store.remote.backend.throttled > 0 and manager.store.remote.backend.inner.window.throttles > 0
            )
    finally:
        proxy.close()
    clean, throttled, after = counts
    assert proxy.injected > 0
    # Half the requests refused: about twice the requests of a clean step (each one tried until it
    # passes, none multiplied by a second retry loop); bound: four times.
    assert throttled <= 4 * clean and after <= clean + 2  # and no backlog of retries once it stops


@pytest.mark.slow
def test_a_store_that_accepts_a_put_and_never_answers_fails_in_bounded_time(tmp_path, moto_endpoint, s3_url, states):
    from support.stores import FaultInjectingProxy, s3_storage_options

    url, _ = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=0.0, stall=("PUT",))
    try:
        with pytest.raises(UploadError, match="within its deadline of 3 s") as caught:
            with CheckpointManager(
                tmp_path,
                world_size=4,
                runtime=ZERO1,
                remote=RemoteOptions(url, storage_options=s3_storage_options(proxy.endpoint)),
                upload=UploadOptions(max_tries=2, backoff_seconds=0, timeout_seconds=1, deadline_seconds=3),
            ) as manager:
                manager.save(1, states)
                manager.wait(uploaded=True)
        assert caught.value.tries >= 2 and "Timeout" in str(caught.value) + str(caught.value.__cause__)
    finally:
        proxy.close()


def test_every_save_with_a_bucket_has_an_upload_future_that_answers(tmp_path, memory_url, states):
    """``handle.uploaded`` is None only without a bucket: a step the bucket's cadence skips, or
    that no tier takes, has a future failed at once with an UploadError of no tries."""
    local = LocalOptions(tmp_path / "ckpt", every=2)
    with two_tier(local, memory_url, every=4) as manager:
        handles = {step: manager.save(step, states) for step in (2, 3, 4)}
        assert handles[4].uploaded is not None and handles[4].uploaded.result(timeout=60) is None
        assert all(handle.replicated == {"remote": handle.uploaded} for handle in handles.values())  # by tier name
        for step, why in ((2, "remote.every"), (3, "no tier's cadence")):
            uploaded = handles[step].uploaded
            assert uploaded is not None and uploaded.done()
            with pytest.raises(UploadError, match=f"step {step} is not uploaded: .*{why}") as raised:
                uploaded.result()
            assert raised.value.step == step and raised.value.tries == 0
        assert handles[2].committed.result(timeout=60) is not None and handles[3].committed.result() is None
        manager.check_for_errors()  # answering a skipped step's future raised nothing in the background
        assert manager.remote_steps() == [4]
    with CheckpointManager(tmp_path / "alone", world_size=4, runtime=ZERO1) as manager:
        assert manager.save(1, states).uploaded is None  # no bucket
