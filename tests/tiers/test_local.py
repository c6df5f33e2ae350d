import json
import os

import numpy as np
import pytest

from support.states import temp_files
from tiered_ckpt import (
    ChecksumMismatchError,
    DirectoryInUseError,
    IncompleteCheckpointError,
    ManifestError,
    UsageError,
)
from tiered_ckpt.format.layout import HELD_NAME, MANIFEST_NAME, RECEIPT_NAME, step_dir_name
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.format.shardfile import write_shard
from tiered_ckpt.format.state import flatten
from tiered_ckpt.io.durable import atomic_write, temp_name
from tiered_ckpt.tiers.base import Landed, ShardSource
from tiered_ckpt.tiers.local import LocalTier


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


@pytest.fixture
def tier(tmp_path):
    """A local tier under its lock, with an empty step 1."""
    tier = LocalTier(tmp_path / "root")
    with tier.lock():
        tier.new_step_dir(1)
        yield tier


def test_the_manifest_of_an_uncommitted_step_is_incomplete(tier):
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        tier.manifest(1)
    (tier.step_dir(1) / MANIFEST_NAME).mkdir()
    with pytest.raises(ManifestError, match="is a directory"):
        tier.manifest(1)


def written_record(tier) -> tuple[ShardRecord, dict]:
    arrays = {"w": np.arange(1000, dtype=np.float32)}
    name = "rank-00000-of-00001.safetensors"
    metadata = flatten(arrays).metadata()  # the structure document every shard carries
    digest = tier.write_shard(1, name, ShardSource(write=lambda out: write_shard(out, arrays, metadata)))
    record = ShardRecord(0, name, digest.sha256, digest.xxh3_64, digest.size_bytes, 0, 1000)
    return record, arrays


def test_shard_file_round_trip_and_size_checks(tier):
    record, arrays = written_record(tier)
    np.testing.assert_array_equal(tier.read_shard(1, record).arrays["w"], arrays["w"])
    path = tier.shard_path(1, record)
    with open(path, "ab") as f:
        f.write(b"!")
    with pytest.raises(ChecksumMismatchError, match=f"rank 0 shard {path}: file has"):
        tier.read_shard(1, record)
    os.truncate(path, record.size_bytes - 100)
    with pytest.raises(IncompleteCheckpointError, match=f"{record.size_bytes - 100} of {record.size_bytes} bytes"):
        tier.read_shard(1, record)
    path.unlink()
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        tier.read_shard(1, record)


def _manifest_of(world_size: int, step: int = 1) -> ShardManifest:
    records = [
        ShardRecord(rank, f"rank-{rank:05d}-of-{world_size:05d}.safetensors", "0" * 64, "0" * 16, 8, rank, 1)
        for rank in range(world_size)
    ]
    return ShardManifest(world_size, step, 0.0, ("w",), tuple(records))


def test_held_ranks_are_every_rank_unless_recorded_and_a_full_record_is_removed(tier):
    manifest = _manifest_of(4)
    assert tier.held_ranks(1, manifest) == [0, 1, 2, 3]
    tier.record_held(1, manifest, [2, 0])
    assert tier.held_ranks(1, manifest) == [0, 2]
    tier.record_held(1, manifest, range(4))
    assert not (tier.step_dir(1) / HELD_NAME).exists() and tier.held_ranks(1, manifest) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "content", [b"{", b"[]", b'{"ranks": [4]}', b'{"ranks": [true]}', b'{"ranks": [0], "extra": 1}', b'{"ranks": "0"}']
)
def test_a_damaged_record_of_held_ranks_is_a_manifest_error_naming_the_file(tier, content):
    (tier.step_dir(1) / HELD_NAME).write_bytes(content)
    with pytest.raises(ManifestError, match=HELD_NAME):
        tier.held_ranks(1, _manifest_of(4))


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

    directory, manifest = committed
    shard = directory / manifest.shard(1).path
    shard.unlink()
    os.mkfifo(shard)
    error = _in_thread(lambda: load_sharded(directory, 2))
    assert isinstance(error, IncompleteCheckpointError) and "is not a regular file" in str(error)
    assert str(shard) in str(error)
    problem = []
    tier = LocalTier(directory, single_step=True)
    assert _in_thread(lambda: problem.append(tier.check_shard(1, manifest.shard(1)))) is None
    assert "is not a regular file" in problem[0]


def test_a_fifo_in_place_of_a_manifest_or_record_does_not_block(committed):
    directory, manifest = committed
    (directory / MANIFEST_NAME).unlink()
    os.mkfifo(directory / MANIFEST_NAME)
    tier = LocalTier(directory, single_step=True)
    error = _in_thread(lambda: tier.manifest(1))
    assert isinstance(error, ManifestError) and "is not a regular file" in str(error)
    os.mkfifo(directory / HELD_NAME)
    error = _in_thread(lambda: tier.held_ranks(1, manifest))
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

    from tiered_ckpt.tiers import local

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

    tier = LocalTier(tmp_path)
    with tier.lock():
        tier.new_step_dir(7)
        assert tier.agreement(7) is None  # no record: a step of a version before them
        tier.commit(_manifest_of(2, step=7), agreed=False)
        assert tier.agreement(7) is False
        tier.mark_agreed(7)
        assert tier.agreement(7) is True
        tier.new_step_dir(8)
        (tier.step_dir(8) / AGREEMENT_NAME).write_bytes((tier.step_dir(7) / AGREEMENT_NAME).read_bytes())
        assert tier.agreement(8) is None  # another step's record
        for damaged in (b"{", b'{"step": 7, "agreed": 1}', b"[]"):
            (tier.step_dir(7) / AGREEMENT_NAME).write_bytes(damaged)
            assert tier.agreement(7) is None
        tier.delete_step(8)
        assert tier.remove_uncommitted() == [] and (tier.step_dir(7) / AGREEMENT_NAME).exists()  # a committed step's


# --- the tier protocol's words on the local disk ------------------------------------------


def test_every_write_needs_the_lock(tmp_path):
    tier = LocalTier(tmp_path)
    manifest = _manifest_of(1)
    source = ShardSource(write=lambda out: write_shard(out, {"w": np.zeros(2, np.float32)}, {}))
    for write in (
        lambda: tier.write_shard(1, manifest.shards[0].path, source),
        lambda: tier.land_shard(1, manifest.shards[0], source),
        lambda: tier.commit(manifest),
        lambda: tier.delete_step(1),
        lambda: tier.new_step_dir(1),
        lambda: tier.mark_agreed(1),
    ):
        with pytest.raises(UsageError, match="needs the directory's lock"):
            write()
    assert os.listdir(tmp_path) == []


def test_a_shard_written_by_name_returns_the_digest_its_record_is_built_from(tier, tmp_path):
    record, arrays = written_record(tier)
    assert tier.check_shard(1, record) is None
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(tier.open_shard(1, record, lambda stream: stream.read()))
    assert tier.land_shard(2, record, ShardSource(path=copy)) == Landed.as_is(record)  # a path source: copied
    assert tier.check_shard(2, record) is None  # its sha256 is the record's
    np.testing.assert_array_equal(tier.read_shard(2, record).arrays["w"], arrays["w"])
    assert tier.uncommitted_steps() == [1, 2] and tier.steps() == []


def test_a_commit_is_not_create_only_and_says_so(tier):
    assert LocalTier.capabilities.create_only_commit is False and LocalTier.name == "local"
    tier.commit(_manifest_of(1))
    other = _manifest_of(2)
    tier.commit(other)  # the writer never commits a step twice; the tier does not refuse it
    assert tier.manifest(1) == other


def test_a_single_step_directory_holds_the_step_its_manifest_names(tmp_path):
    from tiered_ckpt import save_sharded

    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "notes.txt").write_text("the user's")
    manifest = save_sharded([{"w": np.arange(8, dtype=np.float32)}] * 2, directory, step=5)
    tier = LocalTier(directory, single_step=True)
    assert tier.steps() == [5] and tier.uncommitted_steps() == [] and tier.manifest(5) == manifest
    assert tier.step_dir(5) == directory and "single_step=True" in repr(tier)
    with tier.lock():
        tier.delete_step(5)  # the checkpoint's files go, the directory and the rest stay
    assert sorted(os.listdir(directory)) == ["notes.txt"] and tier.steps() == []


def test_a_step_directory_that_is_a_symlink_is_not_a_step(tmp_path):
    tier = LocalTier(tmp_path / "root")
    with tier.lock():
        tier.new_step_dir(1)
        (tier.step_dir(1) / "part").write_bytes(b"a step being written")
        (tier.root / step_dir_name(2)).symlink_to(tier.step_dir(1))
        assert tier.uncommitted_steps() == [1]


def test_only_a_single_step_directory_has_a_single_manifest(tmp_path):
    with pytest.raises(UsageError, match="single-step"):
        LocalTier(tmp_path).single_manifest()
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        LocalTier(tmp_path, single_step=True).single_manifest()


def test_opening_a_step_leaves_a_temp_file_being_written_and_its_writer_clears_crash_leftovers(tmp_path):
    """A restore or pull opens a step while the uploader may be writing its receipt by temp
    name: only the step's own writer, before it writes, removes what a crash left."""
    tier = LocalTier(tmp_path)
    with tier.lock():
        directory = tier.new_step_dir(3)
        in_flight = directory / temp_name(RECEIPT_NAME)
        in_flight.write_bytes(b"{}")
        assert tier.new_step_dir(3) == directory and in_flight.exists()
        assert tier.clear_temp_files(3) == [in_flight.name] and not in_flight.exists()


def test_an_empty_step_directory_is_no_step(tmp_path):
    tier = LocalTier(tmp_path / "root")
    with tier.lock():
        tier.new_step_dir(1)  # made, nothing written into it yet (or a failed pull's, before it was cleaned up)
        assert tier.list_steps() == ([], [])
        (tier.step_dir(1) / "part").write_bytes(b"a step being written")
        assert tier.list_steps() == ([], [1])
