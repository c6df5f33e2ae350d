"""The store's chain (the local copy, else each later tier in order, verified and landed locally) on real files."""

import dataclasses
import logging
import os

import numpy as np
import pytest

from support.memory_tier import MemoryTier
from support.states import flip_byte
from support.stores import save_hashed_and_compressed, save_two_incremental_steps
from tiered_ckpt import (
    CheckpointError,
    CheckpointManager,
    ChecksumMismatchError,
    IncompleteCheckpointError,
    LocalOptions,
    ManifestError,
    UsageError,
    cli,
    load_sharded,
    save_sharded,
)
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.maintenance import pull
from tiered_ckpt.tiers import survey
from tiered_ckpt.tiers.base import ShardSource
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.tier import RemoteTier
from tiered_ckpt.tiers.retention import RetentionPolicy
from tiered_ckpt.tiers.store import TieredStore


@pytest.fixture
def two_tiers(tmp_path, memory_url):
    """A committed step 3 of 2 ranks in a local tier, uploaded and committed in a memory bucket."""
    states = [{"w": np.arange(4096, dtype=np.float32) + rank} for rank in range(2)]
    manifest = save_sharded(states, tmp_path / "ckpt" / step_dir_name(3), step=3)
    url, options = memory_url
    store = TieredStore([LocalTier(tmp_path / "ckpt"), RemoteTier(url, options)])
    landed = [
        store.remote.land_shard(3, record, ShardSource(path=store.local.shard_path(3, record)))
        for record in manifest.shards
    ]
    store.remote.commit(manifest, landed=landed)
    with store.local.lock():
        yield store, manifest, states


def test_an_intact_local_shard_is_read_locally(two_tiers):
    store, manifest, states = two_tiers
    fetched = store.fetch_shard(3, manifest.shard(1))
    state, source = fetched.state, fetched.source
    arrays = state.arrays
    assert source == "local" and arrays["w"].tobytes() == states[1]["w"].tobytes()


@pytest.mark.parametrize("damage", ["flip", "delete", "truncate", "fifo", "symlink"])
def test_a_damaged_local_shard_comes_from_the_bucket_and_is_landed_locally(two_tiers, damage):
    store, manifest, states = two_tiers
    record = manifest.shard(0)
    path = store.local.shard_path(3, record)
    if damage == "flip":
        flip_byte(path, 500)
    elif damage == "delete":
        path.unlink()
    elif damage == "truncate":
        os.truncate(path, 100)
    elif damage == "fifo":  # would block a plain open() forever
        path.unlink()
        os.mkfifo(path)
    else:  # the committed bytes, but through a link that leaves the checkpoint
        os.replace(path, path.parent.parent / "elsewhere")
        path.symlink_to(path.parent.parent / "elsewhere")
    fetched = store.fetch_shard(3, record)
    state, source = fetched.state, fetched.source
    arrays = state.arrays
    assert source == "remote" and arrays["w"].tobytes() == states[0]["w"].tobytes()
    assert store.local.check_shard(3, record) is None  # the local tier was refilled
    assert [name for name in os.listdir(path.parent) if name.startswith(".")] == []


def flip_remote_byte(store, step: int, record, offset: int) -> None:
    """Flip every bit of one byte of ``record``'s object in the (memory) bucket, in place."""
    remote_path = f"{store.remote.backend.root}/{step_dir_name(step)}/{record.path}"
    data = bytearray(store.remote.backend.fs.cat_file(remote_path))
    data[offset] ^= 0xFF
    store.remote.backend.fs.pipe_file(remote_path, bytes(data))


def test_no_copy_verifies_names_every_copy_tried(two_tiers):
    store, manifest, _states = two_tiers
    record = manifest.shard(1)
    flip_byte(store.local.shard_path(3, record), 500)
    flip_remote_byte(store, 3, record, 600)
    with pytest.raises(ChecksumMismatchError, match="rank 1: no copy verifies") as caught:
        store.fetch_shard(3, record)
    message = str(caught.value)
    # the local copy, then the bucket's, named once for its two downloads
    assert "local " in message and message.count(f"remote {store.remote.shard_location(3, record)} (2 tries):") == 1
    assert store.local.check_shard(3, record) is not None  # a bad download never replaced the file


@pytest.fixture
def on_s3(tmp_path, s3_url):
    """``two_tiers``'s step on a real S3 API (moto's server)."""
    states = [{"w": np.arange(4096, dtype=np.float32) + rank} for rank in range(2)]
    manifest = save_sharded(states, tmp_path / "ckpt" / step_dir_name(3), step=3)
    store = TieredStore([LocalTier(tmp_path / "ckpt"), RemoteTier(*s3_url)])
    landed = [
        store.remote.land_shard(3, record, ShardSource(path=store.local.shard_path(3, record)))
        for record in manifest.shards
    ]
    store.remote.commit(manifest, landed=landed)
    with store.local.lock():
        yield store, manifest


def test_a_bucket_copy_that_fails_to_verify_is_named_by_its_key_once(on_s3):
    store, manifest = on_s3
    record = manifest.shard(1)
    local_path = str(store.local.shard_path(3, record))
    flip_byte(store.local.shard_path(3, record), 500)
    key = store.remote.shard_location(3, record)
    flip_remote_byte(store, 3, record, 600)
    with pytest.raises(ChecksumMismatchError, match="rank 1: no copy verifies") as caught:
        store.fetch_shard(3, record)
    local_part, _, remote_part = str(caught.value).partition("; remote ")
    assert local_part.count(local_path) == 2 and "sha256 is" in local_part  # the local copy: its path, its problem
    assert key.startswith("s3://") and remote_part.startswith(f"{key} (2 tries): rank 1 shard {key}: sha256 is ")
    assert local_path not in remote_part and str(store.local.root) not in remote_part  # not where it landed
    assert remote_part.count("sha256 is") == 1  # each copy listed once


def test_without_a_bucket_a_damaged_shard_fails_as_it_is(two_tiers):
    store, manifest, _states = two_tiers
    local_only = TieredStore([store.local])
    store.local.shard_path(3, manifest.shard(0)).unlink()
    with pytest.raises(IncompleteCheckpointError, match="file is missing"):
        local_only.fetch_shard(3, manifest.shard(0))
    with pytest.raises(UsageError, match="needs a remote tier"):
        pull(local_only)


def test_status_and_verify_see_both_tiers(two_tiers):
    store, manifest, _states = two_tiers
    [status] = survey.step_statuses(store)
    assert (status.step, status.local, status.remote) == (3, "committed", "committed")
    assert status.manifest == manifest
    result = survey.verify(store)
    assert result.ok and result.failed == ()
    checks = result.checks
    assert sorted((c.tier, c.rank, c.status) for c in checks) == [
        ("local", 0, "ok"),
        ("local", 1, "ok"),
        ("remote", 0, "ok"),
        ("remote", 1, "ok"),
    ]


def test_pull_fills_an_empty_local_tier(two_tiers, tmp_path):
    store, manifest, states = two_tiers
    fresh = TieredStore([LocalTier(tmp_path / "fresh"), store.remote])
    with fresh.local.lock():
        pulled = pull(fresh)
    assert pulled.step == 3 and pulled.sources == {0: "remote", 1: "remote"}
    assert fresh.local.steps() == [3] and fresh.receipted(3)
    assert fresh.local.read_shard(3, manifest.shard(1)).arrays["w"].tobytes() == states[1]["w"].tobytes()


def test_writes_refuse_a_directory_replaced_under_the_lock(two_tiers, tmp_path):
    import shutil

    store, manifest, _states = two_tiers
    shutil.rmtree(store.local.root)
    store.local.root.mkdir()  # another job's directory now, at the same path
    with pytest.raises(Exception, match="removed or replaced since this job locked it"):
        store.local.new_step_dir(4)


@pytest.fixture
def chunked_tiers(tmp_path, memory_url):
    """Step 3 of one rank holding a DTensor chunk "a" and a plain array "b", in both tiers."""
    import json

    from tiered_ckpt.format.manifest import ShardManifest
    from tiered_ckpt.format.state import FlatState
    from tiered_ckpt.format.structure import Structure
    from tiered_ckpt.oneshot import write_checkpoint

    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4096, dtype=np.float32)}
    root = {"dict": [["a", {"dtensor": ["a", [4, 3], [2, 0]]}], ["b", {"array": "b"}], ["epoch", 3]]}
    structure = Structure.from_json(json.dumps({"version": 1, "root": root}), arrays, "test")
    tier = LocalTier(tmp_path / "ckpt")
    with tier.lock():
        manifest = write_checkpoint(tier, [FlatState(arrays, structure)], 3, sharded_keys=(), numels=[0])
    assert isinstance(manifest, ShardManifest) and {c.name for c in manifest.shard(0).chunks} == {"a", "b"}
    url, options = memory_url
    store = TieredStore([LocalTier(tmp_path / "ckpt"), RemoteTier(url, options)])
    landed = store.remote.land_shard(
        3, manifest.shard(0), ShardSource(path=store.local.shard_path(3, manifest.shard(0)))
    )
    store.remote.commit(manifest, landed=[landed])
    with store.local.lock():
        yield store, manifest, arrays


def byte_of(store, manifest, name: str) -> int:
    """An offset inside array ``name``'s bytes in the local shard."""
    from tiered_ckpt.format.shardfile import read_header

    record = manifest.shard(0)
    with open(store.local.shard_path(3, record), "rb") as shard:
        header = read_header(shard.read(record.header_bytes), record.size_bytes, "test")
    return header.arrays[name].begin + 5


def test_reading_parts_verifies_only_what_it_reads(chunked_tiers):
    store, manifest, arrays = chunked_tiers
    flip_byte(store.local.shard_path(3, manifest.shard(0)), byte_of(store, manifest, "b"))
    state, source = store.read_parts(3, manifest.shard(0), {"a"})
    assert source == "local" and state.arrays["a"].tobytes() == arrays["a"].tobytes()  # "b" was not read
    assert set(state.arrays) == {"a"} and set(state.structure.kinds) == {"a", "b"}  # the whole structure
    state, source = store.read_parts(3, manifest.shard(0), {"a", "b"})
    assert source == "remote" and state.arrays["b"].tobytes() == arrays["b"].tobytes()  # the flip is caught


@pytest.mark.parametrize("where", ["header", "a"])
def test_a_damaged_part_without_a_bucket_is_a_checksum_mismatch_naming_the_file(chunked_tiers, where):
    store, manifest, _arrays = chunked_tiers
    offset = 20 if where == "header" else byte_of(store, manifest, "a")
    flip_byte(store.local.shard_path(3, manifest.shard(0)), offset)
    with pytest.raises(ChecksumMismatchError, match="rank-00000-of-00001"):
        store.read_parts(3, manifest.shard(0), {"a"}, later=())


@pytest.mark.parametrize("verify", ["full", "fast"])
def test_a_damaged_part_is_caught_by_either_recorded_digest(chunked_tiers, verify):
    import dataclasses

    store, manifest, arrays = chunked_tiers
    record = manifest.shard(0)
    assert all(len(chunk.xxh3_64) == 16 for chunk in record.chunks)  # recorded beside each sha256
    state, _source = store.read_parts(3, record, {"a", "b"}, verify=verify, later=())
    assert state.arrays["b"].tobytes() == arrays["b"].tobytes()
    flip_byte(store.local.shard_path(3, record), byte_of(store, manifest, "b"))
    kind = "xxh3-64" if verify == "fast" else "sha256"
    with pytest.raises(ChecksumMismatchError, match=f"'b' do not match the {kind}"):
        store.read_parts(3, record, {"b"}, verify=verify, later=())
    # A record without xxh3-64 digests (written before them): "fast" falls back to the sha256.
    old = dataclasses.replace(record, chunks=tuple(dataclasses.replace(c, xxh3_64="") for c in record.chunks))
    with pytest.raises(ChecksumMismatchError, match="'b' do not match the sha256"):
        store.read_parts(3, old, {"b"}, verify="fast", later=())


def test_any_new_shard_has_a_verifiable_header_and_an_old_record_without_one_is_refused(two_tiers):
    import dataclasses

    from tiered_ckpt import ShardFormatError

    store, manifest, _states = two_tiers
    record = manifest.shard(0)
    assert record.header_bytes > 8 and not record.chunks  # measured for every shard; chunks only for DTensors
    state, source = store.read_parts(3, record, ())
    assert source == "local" and set(state.structure.kinds) == {"w"} and state.arrays == {}
    old = dataclasses.replace(record, header_bytes=0, header_sha256="")
    with pytest.raises(ShardFormatError, match="can only be read whole"):
        store.read_parts(3, old, (), later=())


# --- beside a running job: a step its retention deletes between the listing and the reading ---


@pytest.fixture
def job_dirs(tmp_path, memory_url):
    """Steps 1 and 2 of 2 ranks in a local tier and committed in a memory bucket, without receipts
    (as the CLI sees a running job's directory: steps 1 and 2 waiting for upload)."""
    url, options = memory_url
    store = TieredStore([LocalTier(tmp_path / "ckpt"), RemoteTier(url, options)])
    for step in (1, 2):
        states = [{"w": np.arange(1024, dtype=np.float32) + rank + step} for rank in range(2)]
        manifest = save_sharded(states, store.local.step_dir(step), step=step)
        landed = [
            store.remote.land_shard(step, record, ShardSource(path=store.local.shard_path(step, record)))
            for record in manifest.shards
        ]
        store.remote.commit(manifest, landed=landed)
    return store


def test_a_disks_manifest_is_checked_against_the_leaders_digest_of_the_buckets(job_dirs, monkeypatch):
    store = job_dirs
    with store.local.lock():
        store.record_commit(2, store.remote, store.remote.read_manifest(2))  # the receipt an upload leaves
    first, second = (store.remote.read_manifest(step).manifest.shards_digest() for step in (1, 2))
    read, reads = store.remote.read_manifest, []
    monkeypatch.setattr(store.remote, "read_manifest", lambda step: (reads.append(step), read(step))[1])

    manifest, remote = store.manifests(2, in_local=True, in_remote=True, bucket_shards=second)
    assert manifest == store.local.manifest(2) and remote is None and reads == []
    with pytest.raises(ManifestError, match="manifests of step 2 describe different checkpoints"):
        store.manifests(2, in_local=True, in_remote=True, bucket_shards=first)
    assert reads == []
    # Without the receipt, the bucket's manifest is read: a refill of the step writes it as one
    manifest, remote = store.manifests(1, in_local=True, in_remote=True, bucket_shards=first)
    assert reads == [1] and remote.manifest == manifest
    # A damaged local manifest: the bucket's is read and used
    (store.local.step_dir(2) / "manifest.json").write_text("{")
    manifest, remote = store.manifests(2, in_local=True, in_remote=True, bucket_shards=second)
    assert reads == [1, 2] and manifest == remote.manifest and manifest.shards_digest() == second


def test_a_bucket_read_after_the_digest_check_reads_the_buckets_manifest_first(tmp_path, memory_url, caplog):
    url, options = memory_url
    states = save_hashed_and_compressed(tmp_path / "node", url, options)
    # a process that never read the bucket's manifest; its options say flat and uncompressed
    store = TieredStore([LocalTier(tmp_path / "node"), RemoteTier(url, options)])
    digest = RemoteTier(url, options).read_manifest(1).manifest.shards_digest()
    manifest, remote = store.manifests(1, in_local=True, in_remote=True, bucket_shards=digest)
    assert remote is None
    record = manifest.shard(1)
    flip_byte(store.local.shard_path(1, record), 1000)
    with store.local.lock(), caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        fetched = store.fetch_shard(1, record)
    assert fetched.source == "remote" and fetched.state.arrays["w"].tobytes() == states[1]["w"].tobytes()
    stored = RemoteTier(url, options, layout="hashed").object_name(1, record.path) + ".zst"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"repaired the local copy from {url}/{step_dir_name(1)}/{stored};" in warning, warning


@pytest.mark.parametrize("read", ["read_shard_header", "read_parts"])
def test_a_ranged_read_after_the_digest_check_names_the_copy_where_the_bucket_keeps_it(tmp_path, memory_url, read):
    url, options = memory_url
    save_hashed_and_compressed(tmp_path / "node", url, options)
    store = TieredStore([LocalTier(tmp_path / "node"), RemoteTier(url, options)])  # flat, uncompressed
    digest = RemoteTier(url, options).read_manifest(1).manifest.shards_digest()
    manifest, _remote = store.manifests(1, in_local=True, in_remote=True, bucket_shards=digest)
    # a record whose header neither copy has: every copy tried fails, each named in the error
    record = dataclasses.replace(manifest.shard(1), header_sha256="0" * 64)
    with store.local.lock(), pytest.raises(CheckpointError) as failed:
        store.read_shard_header(1, record) if read == "read_shard_header" else store.read_parts(1, record, ["w"])
    stored = RemoteTier(url, options, layout="hashed").object_name(1, record.path) + ".zst"
    assert f"rank 1 shard {url}/{step_dir_name(1)}/{stored}:" in str(failed.value), failed.value
    assert f"shard {url}/{step_dir_name(1)}/{record.path}" not in str(failed.value)


def test_a_ranged_read_of_a_referenced_file_names_it_where_the_bucket_keeps_it(tmp_path, memory_url):
    url, options = memory_url
    save_two_incremental_steps(tmp_path / "ckpt", url, options)
    digest = RemoteTier(url, options).read_manifest(2).manifest.shards_digest()
    store = TieredStore([LocalTier(tmp_path / "ckpt"), RemoteTier(url, options)])
    with store.local.lock():
        manifest, _remote = store.manifests(2, in_local=True, in_remote=True, bucket_shards=digest)
        record = manifest.shard(0)
        index, _source = store.read_shard_index(2, record)
        (ref,) = record.references
        bad = dataclasses.replace(ref, xxh3_64="0" * len(ref.xxh3_64))  # no copy of the file verifies
        store = TieredStore([LocalTier(tmp_path / "ckpt"), RemoteTier(url, options)])  # knows nothing of the bucket
        with pytest.raises(CheckpointError) as failed:
            store.read_parts(2, dataclasses.replace(record, references=(bad,)), list(bad.names), index=index)
    stored = RemoteTier(url, options, layout="hashed").object_name(1, ref.file.path) + ".zst"
    assert f"shard {url}/{step_dir_name(1)}/{stored} (referenced by step 2):" in str(failed.value), failed.value
    assert f"shard {url}/{step_dir_name(1)}/{ref.file.path} " not in str(failed.value), failed.value


def delete_first(monkeypatch, owner, name: str, step: int, delete) -> None:
    """Make ``owner.name(step, ...)`` first ``delete()`` the step (really, as retention does), once."""
    read, done = getattr(owner, name), []

    def deleting(*args, **kwargs):
        if step in args[:2] and not done:  # (step, ...) on an instance; (self, step, ...) on a class
            done.append(step)  # before the deletion, which may read the step itself (a listing does)
            delete()
        return read(*args, **kwargs)

    monkeypatch.setattr(owner, name, deleting)


def delete_locally(store, step):
    return lambda: delete_step(store.local.root, step)


def delete_step(root, step) -> None:
    """Delete ``step`` under ``root`` as another holder of the directory does (a running job's retention)."""
    tier = LocalTier(root)
    with tier.lock():
        tier.delete_step(step)


def test_verify_skips_a_local_step_deleted_while_its_shards_are_checked(job_dirs, monkeypatch):
    store = TieredStore([job_dirs.local])  # the local tier only
    delete_first(monkeypatch, store.local, "check_shard", 1, delete_locally(store, 1))
    checks = survey.verify(store).checks
    assert [(c.step, c.rank, c.status) for c in checks] == [(2, 0, "ok"), (2, 1, "ok")]


def test_verify_skips_a_step_whose_manifest_is_deleted_before_it_is_read_in_either_tier(job_dirs, monkeypatch):
    store = job_dirs
    delete_first(monkeypatch, store.local, "manifest", 1, delete_locally(store, 1))
    delete_first(monkeypatch, store.remote, "read_manifest", 2, lambda: store.remote.delete_step(2))
    checks = survey.verify(store).checks
    assert sorted((c.step, c.tier, c.status) for c in checks) == [
        (1, "remote", "ok"), (1, "remote", "ok"), (2, "local", "ok"), (2, "local", "ok"),
    ]  # fmt: skip


def test_verify_skips_a_remote_step_deleted_while_its_objects_are_checked(job_dirs, monkeypatch):
    store = job_dirs
    delete_first(monkeypatch, store.remote, "check_shard", 1, lambda: store.remote.delete_step(1))
    checks = survey.verify(store).checks
    assert [(c.step, c.tier) for c in checks if c.status != "ok"] == []
    assert sorted((c.step, c.tier) for c in checks) == [(1, "local")] * 2 + [(2, "local")] * 2 + [(2, "remote")] * 2


def test_a_missing_shard_of_a_step_still_committed_is_a_failure(job_dirs):
    store = TieredStore([job_dirs.local])
    store.local.shard_path(1, store.local.manifest(1).shard(1)).unlink()
    result = survey.verify(store)
    failed = [c for c in result.checks if c.status == "failed"]
    assert [(c.step, c.rank) for c in failed] == [(1, 1)] and "file is missing" in failed[0].problem
    assert list(result.failed) == failed and not result.ok


def test_status_and_lag_leave_out_a_step_deleted_before_its_manifest_is_read(job_dirs, monkeypatch):
    store = job_dirs
    delete_first(monkeypatch, store.local, "manifest", 1, delete_locally(store, 1))
    lag = survey.lag(store)  # steps 1 and 2 have no receipt: both were waiting
    assert [step for step, _size in lag.waiting] == [2]
    assert LocalTier(store.local.root).steps() == [2]
    delete_first(monkeypatch, store.local, "manifest", 2, delete_locally(store, 2))
    rows = survey.step_statuses(store)  # step 2 is still in the bucket: shown there only
    assert [(row.step, row.local, row.remote) for row in rows] == [(1, "-", "committed"), (2, "-", "committed")]
    local_only = TieredStore([LocalTier(store.local.root)])
    assert survey.step_statuses(local_only) == [] and survey.lag(local_only).newest_local is None


def test_the_cli_verify_beside_a_running_job_skips_the_step_its_retention_deletes(job_dirs, monkeypatch, capsys):
    root = job_dirs.local.root
    delete_first(monkeypatch, LocalTier, "check_shard", 1, lambda: delete_step(root, 1))
    assert cli.main(["--local-dir", str(root), "verify"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and "2 shards verified, 0 failed" in out, out


def fail_reads_of(monkeypatch, path) -> None:
    """Make every read of the file now at ``path`` fail with EIO, as a failing disk does (injected
    where the shard reader asks for its blocks, by the file's inode: a copy landed under the
    same name later is a new file, and reads)."""
    import errno
    from contextlib import contextmanager

    from tiered_ckpt.format import shardfile

    bad = os.stat(path).st_ino
    real = shardfile.read_blocks

    @contextmanager
    def read_blocks(fd, size):
        with real(fd, size) as blocks:
            if os.fstat(fd).st_ino != bad:
                yield blocks
                return

            def failing():
                raise OSError(errno.EIO, os.strerror(errno.EIO))
                yield from blocks

            yield failing()

    monkeypatch.setattr(shardfile, "read_blocks", read_blocks)


def test_an_io_error_reading_the_local_shard_takes_the_bucket_copy_and_refills_it(two_tiers, monkeypatch, caplog):
    store, manifest, states = two_tiers
    record = manifest.shard(1)
    path = store.local.shard_path(3, record)
    fail_reads_of(monkeypatch, path)
    with caplog.at_level("WARNING", logger="tiered_ckpt"):
        fetched = store.fetch_shard(3, record)
        state, source = fetched.state, fetched.source
    assert source == "remote" and state.arrays["w"].tobytes() == states[1]["w"].tobytes()
    assert store.local.check_shard(3, record) is None and store.fetch_shard(3, record).source == "local"  # refilled
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "step 3 rank 1: repaired the local copy from memory://" in warning.getMessage()
    assert f"{path}: read error: Input/output error" in warning.getMessage()


def test_an_io_error_with_no_good_copy_names_every_copy_and_its_problem(two_tiers, monkeypatch):
    store, manifest, _states = two_tiers
    record = manifest.shard(1)
    path = store.local.shard_path(3, record)
    fail_reads_of(monkeypatch, path)
    flip_remote_byte(store, 3, record, 600)
    with pytest.raises(ChecksumMismatchError, match="rank 1: no copy verifies") as caught:
        store.fetch_shard(3, record)
    message = str(caught.value)
    assert f"local {path}: rank 1 shard {path}: read error: Input/output error" in message
    assert message.count(" (2 tries): ") == 1 and message.count("sha256") == 1


def test_an_io_error_without_a_bucket_is_an_incomplete_checkpoint_naming_the_file(two_tiers, monkeypatch):
    import errno

    store, manifest, _states = two_tiers
    path = store.local.shard_path(3, manifest.shard(0))
    fail_reads_of(monkeypatch, path)
    with pytest.raises(IncompleteCheckpointError, match=f"rank 0 shard {path}: read error") as caught:
        TieredStore([store.local]).fetch_shard(3, manifest.shard(0))
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.EIO
    with pytest.raises(IncompleteCheckpointError, match=f"rank 0 shard {path}: read error"):
        load_sharded(store.local.step_dir(3), expected_world_size=2)


def test_an_io_error_in_a_partial_read_takes_the_arrays_from_the_bucket(tmp_path, memory_url, monkeypatch, caplog):
    """A state of DTensors reads parts of shards: a read error there (pread, as a failing disk
    answers; through a memory map it would be SIGBUS) is one more reason to read the bucket."""
    import errno

    from test_replicas import chunked_states

    manifest = save_sharded(chunked_states(2), tmp_path / "ckpt" / step_dir_name(3), step=3)
    store = TieredStore([LocalTier(tmp_path / "ckpt"), RemoteTier(*memory_url)])
    landed = [
        store.remote.land_shard(3, record, ShardSource(path=store.local.shard_path(3, record)))
        for record in manifest.shards
    ]
    store.remote.commit(manifest, landed=landed)
    record = manifest.shard(0)
    path = store.local.shard_path(3, record)
    bad, real = os.stat(path).st_ino, os.preadv

    def preadv(fd, buffers, offset, *flags):
        if os.fstat(fd).st_ino == bad:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    with caplog.at_level("WARNING", logger="tiered_ckpt"):
        state, source = store.read_parts(3, record, ["weight"])
    assert source == "remote" and state.arrays["weight"].tobytes() == chunked_states(2)[0]["weight"].data.tobytes()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "step 3 rank 0: read it instead from memory://" in warning
    assert f"rank 0 shard {path}: read error: Input/output error" in warning
    with pytest.raises(IncompleteCheckpointError, match=f"rank 0 shard {path}: read error") as caught:
        TieredStore([store.local]).read_parts(3, record, ["weight"])
    assert caught.value.__cause__.errno == errno.EIO


# -- a store of more tiers than a disk and a bucket ------------------------------------------


@pytest.fixture
def three_tiers(tmp_path, memory_url):
    """Step 3 of 2 ranks on the local disk, in a partner's memory (not durable) and in a bucket."""
    states = [{"w": np.arange(4096, dtype=np.float32) + rank} for rank in range(2)]
    manifest = save_sharded(states, tmp_path / "ckpt" / step_dir_name(3), step=3)
    peer, bucket = MemoryTier("peer"), RemoteTier(*memory_url)
    store = TieredStore([LocalTier(tmp_path / "ckpt"), peer, bucket])
    for tier in (peer, bucket):
        landed = [
            tier.land_shard(3, record, ShardSource(path=store.local.shard_path(3, record)))
            for record in manifest.shards
        ]
        tier.commit(manifest, landed=landed)
    with store.local.lock():
        yield store, peer, bucket, manifest, states


def test_the_chain_walks_the_tiers_in_order_and_the_nearest_copy_that_verifies_wins(three_tiers):
    store, peer, _bucket, manifest, states = three_tiers
    record = manifest.shard(0)
    flip_byte(store.local.shard_path(3, record), 100)
    fetched = store.fetch_shard(3, record)
    state, source = fetched.state, fetched.source
    assert source == "peer" and state.arrays["w"].tobytes() == states[0]["w"].tobytes()
    assert store.local.check_shard(3, record) is None  # refilled from the partner
    flip_byte(store.local.shard_path(3, record), 100)
    del peer.shards[(3, record.path)]  # the partner lost it too
    fetched = store.fetch_shard(3, record)
    state, source = fetched.state, fetched.source
    assert source == "remote" and state.arrays["w"].tobytes() == states[0]["w"].tobytes()
    assert store.fetch_shard(3, record).source == "local"


def test_a_shard_no_tier_holds_intact_is_an_error_naming_every_copy_tried(three_tiers):
    store, peer, bucket, manifest, _states = three_tiers
    record = manifest.shard(1)
    flip_byte(store.local.shard_path(3, record), 7)
    peer.shards[(3, record.path)] = b"not the shard"
    bucket.backend.fs.rm_file(f"{bucket.backend.root}/{step_dir_name(3)}/{record.path}")
    with pytest.raises(ChecksumMismatchError, match="rank 1: no copy verifies") as caught:
        store.fetch_shard(3, record)
    message = str(caught.value)
    for copy in (f"local {store.local.shard_path(3, record)}", f"peer {peer.shard_location(3, record)}", "remote "):
        assert copy in message
    assert message.count("remote ") == 1 and message.count(" (2 tries): ") == 2  # a later tier is tried twice


def test_parts_of_a_shard_come_from_the_nearest_tier_that_serves_ranges(tmp_path, memory_url):
    from test_replicas import chunked_states

    manifest = save_sharded(chunked_states(2), tmp_path / "ckpt" / step_dir_name(3), step=3)
    peer = MemoryTier("peer")
    store = TieredStore([LocalTier(tmp_path / "ckpt"), peer, RemoteTier(*memory_url)])  # the bucket is empty
    record = manifest.shard(1)
    peer.land_shard(3, record, ShardSource(path=store.local.shard_path(3, record)))
    store.local.shard_path(3, record).unlink()
    state, source = store.read_parts(3, record, ["weight"])
    assert source == "peer" and state.arrays["weight"].tobytes() == chunked_states(2)[1]["weight"].data.tobytes()
    assert store.local.check_shard(3, record) is not None  # a ranged read refills nothing
    with pytest.raises(IncompleteCheckpointError, match="file is missing"):
        store.read_parts(3, record, ["weight"], later=())


def test_status_lag_and_verify_name_every_tier(three_tiers, tmp_path):
    store, peer, _bucket, manifest, _states = three_tiers
    save_sharded([{"w": np.zeros(8, np.float32)}] * 2, tmp_path / "ckpt" / step_dir_name(4), step=4)
    rows = survey.step_statuses(store)
    assert [(row.step, dict(row.states)) for row in rows] == [
        (3, {"local": "committed", "peer": "committed", "remote": "committed"}),
        (4, {"local": "committed", "peer": "-", "remote": "uploading"}),  # no receipt of a memory's commit
    ]
    lag = survey.lag(store)
    assert dict(lag.newest) == {"local": 4, "peer": 3, "remote": 3}
    assert [step for step, _bytes in lag.waiting] == [3, 4]  # no receipts: step 3 too waits for the bucket
    assert {key: lag.to_dict()[key] for key in ("newest_local", "newest_peer", "newest_remote")} == dict(
        newest_local=4, newest_peer=3, newest_remote=3
    )
    peer.shards[(3, manifest.shard(0).path)] = b"x"
    result = survey.verify(store, 3)
    assert [(check.tier, check.rank) for check in result.failed] == [("peer", 0)] and not result.ok
    assert [(check.tier, check.rank, check.status) for check in result.checks] == [
        ("local", 0, "ok"), ("local", 1, "ok"), ("peer", 0, "failed"), ("peer", 1, "ok"),
        ("remote", 0, "ok"), ("remote", 1, "ok"),
    ]  # fmt: skip
    assert [check.tier for check in survey.verify(store, 3, later_only=True).checks] == ["peer"] * 2 + ["remote"] * 2
    with pytest.raises(IncompleteCheckpointError, match="step 4 is committed in no tier checked"):
        survey.verify(store, 4, later_only=True)  # on the local disk only


def test_a_store_refuses_tiers_it_cannot_compose_naming_them(tmp_path):
    local = LocalTier(tmp_path / "ckpt")
    with pytest.raises(UsageError, match="first tier is this node's disk"):
        TieredStore([MemoryTier("peer"), local])
    with pytest.raises(UsageError, match=r"names of their own, got \['local', 'peer', 'peer'\]"):
        TieredStore([local, MemoryTier("peer"), MemoryTier("peer")])
    with pytest.raises(UsageError, match=r"retention names tiers the store does not have: \['remote'\]"):
        TieredStore([local], {"remote": RetentionPolicy(keep_last=1)})
    store = TieredStore([local, MemoryTier("peer")])
    assert store.remote is None and store.tier("peer").name == "peer"  # a memory is no bucket
    with pytest.raises(UsageError, match="no tier 'remote'"):
        store.tier("remote")


def test_a_read_tries_the_bucket_only_where_it_committed_the_step_and_every_other_tier(three_tiers, tmp_path):
    store, peer, _bucket, _manifest, states = three_tiers
    assert store.readable(True) == ("peer", "remote") and store.readable(False) == ("peer",)
    manifest = save_sharded(states, tmp_path / "ckpt" / step_dir_name(4), step=4)
    for record in manifest.shards:  # the partner holds step 4, the bucket not yet
        peer.land_shard(4, record, ShardSource(path=store.local.shard_path(4, record)))
    flip_byte(store.local.shard_path(4, manifest.shard(0)), 200)
    fetched = store.fetch_shard(4, manifest.shard(0), later=store.readable(False))
    state, source = fetched.state, fetched.source
    assert source == "peer" and state.arrays["w"].tobytes() == states[0]["w"].tobytes()


def test_a_store_holds_any_number_of_durable_later_tiers_and_its_bucket_is_the_one_with_receipts(tmp_path, memory_url):
    local = LocalTier(tmp_path / "ckpt")
    archive, shared = MemoryTier("archive", durable=True), MemoryTier("shared", durable=True, shared=True)
    store = TieredStore([local, archive, shared])  # durable, but no receipts: no bucket
    assert store.remote is None and store.later == (archive, shared)
    bucket = RemoteTier(*memory_url)
    store = TieredStore([local, MemoryTier("peer"), archive, bucket, shared])
    assert store.remote is bucket  # the first later tier with receipts, wherever it stands
    with pytest.raises(UsageError, match="only a tier with receipts has its commits recorded"):
        store.record_commit(3, store.tier("archive"), None)


def test_an_earlier_file_is_found_in_the_bucket_after_a_restore_checked_by_digest(tmp_path, memory_url):
    """A process that restored step 2 from its disk without reading the bucket's manifest, then
    sends a step referencing step 1's file: the bucket keeps it (hashed, compressed), not sent again."""
    url, options = memory_url
    save_two_incremental_steps(tmp_path / "ckpt", url, options)
    digest = RemoteTier(url, options).read_manifest(2).manifest.shards_digest()
    bucket = RemoteTier(url, options)  # a reader's options: flat, uncompressed
    store = TieredStore([LocalTier(tmp_path / "ckpt"), bucket])
    with store.local.lock():
        manifest, remote = store.manifests(2, in_local=True, in_remote=True, bucket_shards=digest)
        assert remote is None
        (ref,) = manifest.shard(0).references
        landed = store.send_referenced(ref, bucket)
    assert not landed.sent and landed.step == 1  # found where the bucket keeps it
    assert landed.location == RemoteTier(url, options, layout="hashed").object_name(1, ref.file.path), landed


def test_a_referenced_file_moved_to_its_kept_directory_mid_upload_is_landed_from_there(tmp_path, memory_url):
    """Retention deletes the referenced file's step while an upload reads it: the file moves to
    the step's kept directory, the landing fails, and is made again from there."""
    from tiered_ckpt.tiers.remote.backends.wrappers import Wrapper

    base = {f"layer{i}": np.full((32, 64), i, np.float32) for i in range(3)}
    with CheckpointManager(LocalOptions(tmp_path / "ckpt"), world_size=1) as manager:
        for step in (1, 2):
            manager.save(step, {"base": base, "adapter": np.full((32, 64), step, np.float32)}, blocking=True)
    local = LocalTier(tmp_path / "ckpt")
    moves = []

    class MovingItAway(Wrapper):
        def put_shard(self, local_path, path, record, *, deadline):
            if step_dir_name(1) in path and not moves:
                moves.append(path)
                local.delete_step(1)  # step 2 references its file: it moves to kept-step-...
            return self.inner.put_shard(local_path, path, record, deadline=deadline)

    bucket = RemoteTier(*memory_url, wrap=MovingItAway)
    store = TieredStore([local, bucket])
    with local.lock():
        ref = local.manifest(2).shard(0).references[0]
        landed = store.send_referenced(ref, bucket)
    assert moves and landed.step == 1 and landed.sent
    assert (tmp_path / "ckpt" / f"kept-{step_dir_name(1)}" / ref.file.path).is_file()
    assert bucket.check_shard(1, ref.file) is None
