import json
import os

import numpy as np
import pytest

from conftest import temp_files
from tiered_ckpt import ChecksumMismatchError, DirectoryInUseError, IncompleteCheckpointError, ManifestError
from tiered_ckpt.format.layout import HELD_NAME, MANIFEST_NAME
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.io.durable import temp_name
from tiered_ckpt.tiers.local import (
    atomic_write,
    directory_lock,
    held_ranks,
    read_manifest,
    read_shard_file,
    record_held_ranks,
    remove_temp_files,
    write_shard_file,
)


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "file"
    target.write_bytes(b"old")
    assert atomic_write(target, lambda out: out.write(b"new content")) == 11
    assert target.read_bytes() == b"new content"
    assert temp_files(tmp_path) == []


def test_failed_atomic_write_leaves_old_content_and_no_temp_file(tmp_path):
    target = tmp_path / "file"
    target.write_bytes(b"old")

    def half_then_fail(out):
        out.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, half_then_fail)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["file"]


def test_remove_temp_files_removes_only_temp_files_of_the_given_targets(tmp_path):
    keep = ["manifest.json", "rank-00000-of-00002.safetensors", ".hidden"]
    for name in keep:
        (tmp_path / name).write_bytes(b"x")
    rank0_temp = temp_name("rank-00000-of-00002.safetensors")
    rank1_temp = temp_name("rank-00001-of-00002.safetensors")
    for name in (rank0_temp, rank1_temp):
        (tmp_path / name).write_bytes(b"partial")
    assert remove_temp_files(tmp_path, {"rank-00001-of-00002.safetensors"}) == [rank1_temp]
    assert remove_temp_files(tmp_path) == [rank0_temp]
    assert sorted(os.listdir(tmp_path)) == sorted(keep)


def test_directory_lock_refuses_a_second_holder(tmp_path):
    with directory_lock(tmp_path):
        with pytest.raises(DirectoryInUseError, match="in use by another"):
            with directory_lock(tmp_path):
                pass
    with directory_lock(tmp_path):
        pass
    assert os.listdir(tmp_path) == []


def test_read_manifest_of_uncommitted_directory_is_incomplete(tmp_path):
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).mkdir()
    with pytest.raises(ManifestError, match="is a directory"):
        read_manifest(tmp_path)


def written_record(tmp_path) -> tuple[ShardRecord, dict]:
    arrays = {"w": np.arange(1000, dtype=np.float32)}
    digest = write_shard_file(tmp_path / "rank-00000-of-00001.safetensors", arrays, {})
    record = ShardRecord(
        0, "rank-00000-of-00001.safetensors", digest.sha256, digest.xxh3_64, digest.size_bytes, 0, 1000
    )
    return record, arrays


def test_shard_file_round_trip_and_size_checks(tmp_path):
    record, arrays = written_record(tmp_path)
    np.testing.assert_array_equal(read_shard_file(tmp_path, record).arrays["w"], arrays["w"])
    path = tmp_path / record.path
    with open(path, "ab") as f:
        f.write(b"!")
    with pytest.raises(ChecksumMismatchError, match=f"rank 0 shard {path}: file has"):
        read_shard_file(tmp_path, record)
    os.truncate(path, record.size_bytes - 100)
    with pytest.raises(IncompleteCheckpointError, match=f"{record.size_bytes - 100} of {record.size_bytes} bytes"):
        read_shard_file(tmp_path, record)
    path.unlink()
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        read_shard_file(tmp_path, record)


def _manifest_of(world_size: int) -> ShardManifest:
    records = [
        ShardRecord(rank, f"rank-{rank:05d}-of-{world_size:05d}.safetensors", "0" * 64, "0" * 16, 8, rank, 1)
        for rank in range(world_size)
    ]
    return ShardManifest(world_size, 1, 0.0, ("w",), tuple(records))


def test_held_ranks_are_every_rank_unless_recorded_and_a_full_record_is_removed(tmp_path):
    manifest = _manifest_of(4)
    assert held_ranks(tmp_path, manifest) == [0, 1, 2, 3]
    record_held_ranks(tmp_path, manifest, [2, 0])
    assert held_ranks(tmp_path, manifest) == [0, 2]
    record_held_ranks(tmp_path, manifest, range(4))
    assert not (tmp_path / HELD_NAME).exists() and held_ranks(tmp_path, manifest) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "content", [b"{", b"[]", b'{"ranks": [4]}', b'{"ranks": [true]}', b'{"ranks": [0], "extra": 1}', b'{"ranks": "0"}']
)
def test_a_damaged_record_of_held_ranks_is_a_manifest_error_naming_the_file(tmp_path, content):
    (tmp_path / HELD_NAME).write_bytes(content)
    with pytest.raises(ManifestError, match=HELD_NAME):
        held_ranks(tmp_path, _manifest_of(4))


# --- files that are not what was committed ---------------------------------------------


def _in_thread(action):
    """Run ``action`` in a daemon thread; return its exception (None if it returned).

    The join's timeout is a guard against a hang (the defect these tests pin down), not
    a timing assertion: a correct read returns at once.
    """
    import threading

    outcome = []

    def run():
        try:
            action()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 -- handed back to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the read blocked"
    return outcome[0]


@pytest.fixture
def committed(tmp_path):
    from tiered_ckpt import save_sharded

    manifest = save_sharded([{"w": np.arange(64, dtype=np.float32)}] * 2, tmp_path / "ckpt", step=1)
    return tmp_path / "ckpt", manifest


def test_a_fifo_in_place_of_a_shard_fails_at_once_instead_of_blocking(committed):
    from tiered_ckpt import load_sharded
    from tiered_ckpt.tiers.local import check_shard_file

    directory, manifest = committed
    shard = directory / manifest.shard(1).path
    shard.unlink()
    os.mkfifo(shard)
    error = _in_thread(lambda: load_sharded(directory, 2))
    assert isinstance(error, IncompleteCheckpointError) and "is not a regular file" in str(error)
    assert str(shard) in str(error)
    problem = []
    assert _in_thread(lambda: problem.append(check_shard_file(directory, manifest.shard(1)))) is None
    assert "is not a regular file" in problem[0]


def test_a_fifo_in_place_of_a_manifest_or_record_does_not_block(committed):
    directory, manifest = committed
    (directory / MANIFEST_NAME).unlink()
    os.mkfifo(directory / MANIFEST_NAME)
    error = _in_thread(lambda: read_manifest(directory))
    assert isinstance(error, ManifestError) and "is not a regular file" in str(error)
    os.mkfifo(directory / HELD_NAME)
    error = _in_thread(lambda: held_ranks(directory, manifest))
    assert isinstance(error, ManifestError) and HELD_NAME in str(error)


def test_a_symlinked_shard_is_refused_even_if_its_target_verifies(committed, tmp_path):
    from tiered_ckpt import load_sharded

    directory, manifest = committed
    shard = directory / manifest.shard(0).path
    elsewhere = tmp_path / "elsewhere.safetensors"
    os.replace(shard, elsewhere)  # the very bytes that were committed, outside the checkpoint
    shard.symlink_to(elsewhere)
    with pytest.raises(IncompleteCheckpointError, match="is a symbolic link"):
        load_sharded(directory, 2)


def test_a_manifest_is_read_without_allocating_more_than_it_holds(committed):
    """Under an address-space limit of what the process already maps plus 64 MiB, reading a
    small manifest succeeds (the limit a read of the size bound, 256 MiB, would break)."""
    import subprocess
    import sys

    directory, _manifest = committed
    code = (
        "import resource, sys\n"
        "from tiered_ckpt import load_sharded\n"
        "size = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20),) * 2)\n"
        f"print(len(load_sharded({str(directory)!r}, 2)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2"


def test_a_step_directory_whose_manifest_names_another_step_is_refused(committed, tmp_path):
    import shutil

    from tiered_ckpt.format.layout import step_dir_name
    from tiered_ckpt.tiers.local import LocalTier

    directory, _manifest = committed
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(directory, root / step_dir_name(9))  # holds step 1's checkpoint
    with pytest.raises(ManifestError, match="field 'step' is 1, the directory is step 9"):
        LocalTier(root).manifest(9)


@pytest.mark.parametrize(
    "path, problem",
    [
        ("é" * 128, "not a plain file name"),  # 128 characters, 256 bytes: over what a file system takes
        ("rank-\udcff.safetensors", "not a plain file name"),  # a lone surrogate has no UTF-8 form
    ],
)
def test_shard_paths_the_os_would_refuse_are_refused_by_the_manifest(committed, path, problem):
    directory, manifest = committed
    document = json.loads((directory / MANIFEST_NAME).read_text())
    document["shards"][0]["path"] = path
    with pytest.raises(ManifestError, match=problem):
        ShardManifest.from_json(json.dumps(document), source="m.json")


def test_a_directory_in_place_of_a_shard_is_incomplete(committed):
    from tiered_ckpt import load_sharded

    directory, manifest = committed
    shard = directory / manifest.shard(0).path
    shard.unlink()
    shard.mkdir()
    with pytest.raises(IncompleteCheckpointError, match="is a directory"):
        load_sharded(directory, 2)


def test_a_lock_removes_the_directories_it_created_if_they_are_still_empty(tmp_path):
    from tiered_ckpt.format.layout import step_dir_name
    from tiered_ckpt.tiers.local import LocalTier

    tier = LocalTier(tmp_path / "job" / "rank-2")
    with tier.lock():
        assert tier.root.is_dir()
    assert not (tmp_path / "job").exists()  # a job that failed before its first save leaves nothing
    with tier.lock():
        tier.new_step_dir(1)
    assert (tier.root / step_dir_name(1)).is_dir()  # anything written is kept
    existing = LocalTier(tmp_path / "kept")
    existing.root.mkdir()
    with existing.lock():
        pass
    assert existing.root.is_dir()  # a directory it did not create is never removed


def test_a_lock_taken_while_another_holder_removes_the_new_directory_makes_it_again(tmp_path, monkeypatch):
    """The second manager's mkdir lands before the first's release removes the (empty) directory
    it created, and the second's open after: run in that order, deterministically."""
    from contextlib import ExitStack

    from tiered_ckpt.format.layout import step_dir_name
    from tiered_ckpt.tiers import local
    from tiered_ckpt.tiers.local import LocalTier

    first, second = LocalTier(tmp_path / "job" / "rank-0"), LocalTier(tmp_path / "job" / "rank-0")
    holding = ExitStack()
    holding.enter_context(first.lock())
    real_lock = local.directory_lock
    calls = []

    def release_first_then_lock(directory):
        calls.append(directory)
        if len(calls) == 1:
            holding.close()  # the first manager closes: its directories, still empty, are removed
            assert not directory.exists()
        return real_lock(directory)

    monkeypatch.setattr(local, "directory_lock", release_first_then_lock)
    with second.lock():
        assert second.root.is_dir() and len(calls) == 2
        second.new_step_dir(1)  # the lock is on the directory now at root
    assert (second.root / step_dir_name(1)).is_dir()

    def removed_every_time(directory):
        directory.rmdir()
        return real_lock(directory)

    monkeypatch.setattr(local, "directory_lock", removed_every_time)
    with pytest.raises(DirectoryInUseError, match="removed twice while this job was taking its lock"):
        with LocalTier(tmp_path / "other").lock():
            pass


def test_the_record_of_a_commits_agreement_reads_back_and_a_bad_one_says_nothing(tmp_path):
    from tiered_ckpt.format.layout import AGREEMENT_NAME
    from tiered_ckpt.tiers.local import read_agreement, record_agreement, remove_uncommitted

    directory = tmp_path / "step-000000000007"
    directory.mkdir()
    assert read_agreement(directory, 7) is None  # no record: a step of a version before them
    record_agreement(directory, 7, False)
    assert read_agreement(directory, 7) is False
    record_agreement(directory, 7, True)
    assert read_agreement(directory, 7) is True and read_agreement(directory, 8) is None  # another step's record
    for damaged in (b"{", b'{"step": 7, "agreed": 1}', b"[]"):
        (directory / AGREEMENT_NAME).write_bytes(damaged)
        assert read_agreement(directory, 7) is None
    (directory / MANIFEST_NAME).write_bytes(b"{}")
    assert remove_uncommitted(tmp_path) == [] and (directory / AGREEMENT_NAME).exists()  # part of a committed step
