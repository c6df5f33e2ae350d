import errno
import os
import shutil
import subprocess

import numpy as np
import pytest

from conftest import (
    BYTES_PER_RANK,
    ZERO1_SHARDED_KEYS,
    assert_states_equal,
    flip_byte,
    kill_child_at,
    large_states,
    running_as_root,
    temp_files,
    zero1_states,
)
from tiered_ckpt import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointManager,
    ChecksumMismatchError,
    DirectoryInUseError,
    IncompleteCheckpointError,
    InvalidStateError,
    ManifestError,
    SaveError,
    WorldSizeMismatchError,
)
from tiered_ckpt.layout import MANIFEST_NAME, step_dir_name, temp_name
from tiered_ckpt.manager import StagingBuffers


@pytest.fixture
def manager(tmp_path):
    with CheckpointManager(tmp_path / "ckpt", world_size=4, sharded_keys=ZERO1_SHARDED_KEYS) as manager:
        yield manager


def test_async_save_then_restore_round_trips(manager, states):
    handle = manager.save(100, states)
    manifest = handle.wait()
    assert handle.done() and handle.manifest == manifest and manifest.step == 100
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


def test_staging_buffers_are_reused_and_reallocated_only_when_shapes_change():
    staging = StagingBuffers()
    first = staging.stage([{"a": np.ones(4), "b": np.zeros(2, np.int8)}])
    second = staging.stage([{"a": np.full(4, 2.0), "b": np.ones(2, np.int8)}])
    assert second[0]["a"] is first[0]["a"] and second[0]["b"] is first[0]["b"]
    np.testing.assert_array_equal(second[0]["a"], np.full(4, 2.0))
    third = staging.stage([{"a": np.ones(5)}])
    assert third[0]["a"] is not first[0]["a"] and "b" not in third[0]
    assert staging.nbytes == 40


def test_blocking_save_and_several_steps(manager, states):
    for step in (10, 20, 30):
        manager.save(step, states, blocking=True)
    assert manager.steps() == [10, 20, 30]
    assert manager.restore(20).step == 20


def test_retention_keeps_the_newest_and_every_tenth(tmp_path):
    with CheckpointManager(
        tmp_path, world_size=2, keep_last=2, keep_every=10, sharded_keys=ZERO1_SHARDED_KEYS
    ) as manager:
        for step in range(1, 26):
            manager.save(step, zero1_states(2, 64, seed=step), blocking=step % 5 == 0)
        manager.wait()
        assert manager.steps() == [10, 20, 24, 25]
        assert sorted(os.listdir(tmp_path)) == [step_dir_name(s) for s in (10, 20, 24, 25)]
        assert_states_equal(zero1_states(2, 64, seed=10), manager.restore(10).states)


def test_retention_never_deletes_the_newest_step(tmp_path, states):
    with CheckpointManager(tmp_path, world_size=4, keep_last=1, sharded_keys=ZERO1_SHARDED_KEYS) as manager:
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
    states[1]["bad"] = np.ones(2, np.complex64)
    with pytest.raises(InvalidStateError, match="rank 1: array 'bad' has dtype complex64"):
        manager.save(1, states)
    assert os.listdir(manager.root) == []


def test_a_second_manager_on_the_same_directory_is_refused(tmp_path):
    with CheckpointManager(tmp_path, world_size=1):
        with pytest.raises(DirectoryInUseError):
            CheckpointManager(tmp_path, world_size=1)
    CheckpointManager(tmp_path, world_size=1).close()


def test_start_removes_what_crashed_saves_left_and_nothing_else(tmp_path, states):
    with CheckpointManager(tmp_path, world_size=4, sharded_keys=ZERO1_SHARDED_KEYS) as manager:
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
    manager = CheckpointManager(tmp_path, world_size=4, sharded_keys=ZERO1_SHARDED_KEYS)
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
        handle.wait()
    assert handle.manifest is None
    manager.close()


def test_read_only_directory_fails_the_background_save(tmp_path, states):
    if not running_as_root() or shutil.which("chattr") is None:
        pytest.skip("making a directory immutable for root needs chattr and root")
    manager = CheckpointManager(tmp_path, world_size=4, sharded_keys=ZERO1_SHARDED_KEYS)
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


def test_sigkill_during_background_write_then_restart_restores_previous_step(tmp_path):
    kill_child_at(tmp_path, f"shard-bytes:{BYTES_PER_RANK}", "manager")
    assert (tmp_path / step_dir_name(2)).exists()  # the killed step's partial files
    with CheckpointManager(tmp_path, world_size=4) as manager:
        assert manager.steps() == [1]
        assert not (tmp_path / step_dir_name(2)).exists()
        result = manager.restore()
        assert result.step == 1
        assert_states_equal(large_states(4, BYTES_PER_RANK, version=1), result.states)
