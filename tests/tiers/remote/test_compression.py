"""Shards compressed on their way to the bucket (tiered_ckpt/tiers/remote/compression.py): through the
manager on every backend, a bucket holding compressed and uncompressed steps, flipped bytes in a
compressed object, ranged reads fetching only the frames they need, verify --remote by the
store's checksums, and the compressed copy a landing makes and removes."""

import functools
import json
import logging
import shutil

import ml_dtypes
import numpy as np
import pytest

from support.memory_tier import MemoryTier
from support.processes import launch_ranks
from support.states import flip_byte, temp_files
from tiered_ckpt import (
    CheckpointManager,
    ChecksumMismatchError,
    ConfigError,
    RemoteError,
    RemoteOptions,
    save_sharded,
)
from tiered_ckpt.format.layout import MANIFEST_NAME, step_dir_name
from tiered_ckpt.io import zstd_frames
from tiered_ckpt.tiers import survey
from tiered_ckpt.tiers.base import ShardSource
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote import compression
from tiered_ckpt.tiers.remote.backends.wrappers import Wrapper
from tiered_ckpt.tiers.remote.tier import RemoteTier, RetryPolicy
from tiered_ckpt.tiers.store import TieredStore


def trained(rank: int, numel: int = 60_000) -> dict:
    """A rank's state as training leaves it: bf16 weights of small magnitude, their fp32 master
    copy and AdamW moments of other scales (the exponent bytes compress; the mantissas do not)."""
    rng = np.random.default_rng(rank)
    weights = rng.standard_normal(numel, dtype=np.float32) * 0.02
    grads = rng.standard_normal(numel, dtype=np.float32) * 1e-3
    return {
        "model": {"w": weights.astype(ml_dtypes.bfloat16), "norm": np.ones(256, np.float32)},
        "optim": {"master": weights, "exp_avg": grads * 0.1, "exp_avg_sq": grads * grads * 1e-3, "lr": 1e-4},
        "step": 7,
    }


def same(left: dict, right: dict) -> None:
    assert left.keys() == right.keys()
    for key, value in left.items():
        if isinstance(value, dict):
            same(value, right[key])
        elif isinstance(value, np.ndarray):
            assert value.dtype == right[key].dtype and value.tobytes() == right[key].tobytes(), key
        else:
            assert value == right[key], key


@pytest.fixture
def small_frames(monkeypatch):
    """Frames of 64 KiB (the least an entry may say), so a small shard spans many."""
    monkeypatch.setattr(compression, "FRAME_BYTES", 64 << 10)


def compressed_step(tmp_path, url, options, step=3, ranks=2):
    """``step`` of ``ranks`` trained states saved locally and landed and committed, compressed."""
    manifest = save_sharded(
        [trained(rank) for rank in range(ranks)], tmp_path / "ckpt" / step_dir_name(step), step=step
    )
    tier = RemoteTier(url, options, compression="zstd")
    landed = [
        tier.land_shard(step, record, ShardSource(path=tmp_path / "ckpt" / step_dir_name(step) / record.path))
        for record in manifest.shards
    ]
    return manifest, tier, tier.commit(manifest, landed=landed)


def object_key(tier, step, record) -> str:
    return f"{tier.backend.root}/{step_dir_name(step)}/{tier.object_name(step, record.path)}.zst"


# -- end to end ------------------------------------------------------------------------------


def test_a_compressed_bucket_restores_a_new_node_whose_reader_compresses_nothing(tmp_path, remote_url):
    url, options = remote_url
    remote = RemoteOptions(url, storage_options=options, compression="zstd")
    with CheckpointManager(tmp_path / "a", world_size=2, remote=remote) as manager:
        manager.save(5, [trained(0), trained(1)], blocking=True)
        manager.wait(uploaded=True)
    assert temp_files(tmp_path / "a" / step_dir_name(5)) == []  # the compressed copies are gone
    tier = RemoteTier(url, options)
    committed = tier.read_manifest(5)
    for record in committed.manifest.shards:
        stored = committed.compression[record.path]
        assert stored.size_bytes < 0.95 * record.size_bytes  # bf16 and fp32 exponents shrink
        assert tier.backend.size(object_key(tier, 5, record)) == stored.size_bytes
        assert not tier.backend.exists(object_key(tier, 5, record).removesuffix(".zst"))
        if tier.capabilities.store_checksums:  # of the compressed object: what the store received
            assert committed.store_checksums[record.path].startswith(("crc32c:", "md5:"))  # S3, GCS; Azure
    shutil.rmtree(tmp_path / "a")  # a new node: only the bucket holds the step
    with CheckpointManager(tmp_path / "b", world_size=2, remote=RemoteOptions(url, storage_options=options)) as b:
        result = b.restore()
        assert result.sources == {0: "remote", 1: "remote"} and b.verify(5).ok
    for rank in range(2):
        same(result.states[rank], trained(rank))
    from safetensors.numpy import load_file  # the local tier is refilled with plain shard files

    refilled = load_file(str(tmp_path / "b" / step_dir_name(5) / committed.manifest.shard(1).path))
    assert refilled["optim/master"].tobytes() == trained(1)["optim"]["master"].tobytes()


@pytest.mark.slow
def test_a_bucket_holding_compressed_and_uncompressed_steps_reads_both_whatever_the_option(tmp_path, s3_url):
    url, options = s3_url
    for step, kind in ((1, "none"), (2, "zstd")):
        remote = RemoteOptions(url, storage_options=options, compression=kind)
        with CheckpointManager(tmp_path / "a", world_size=2, remote=remote) as manager:
            manager.save(step, [trained(step), trained(step + 10)], blocking=True)
    tier = RemoteTier(url, options)
    assert tier.read_manifest(1).compression == {} and len(tier.read_manifest(2).compression) == 2
    assert "compression" not in json.loads(tier.backend.read(f"{tier.backend.root}/{step_dir_name(1)}/manifest.json"))
    for kind in ("none", "zstd"):
        shutil.rmtree(tmp_path / "b", ignore_errors=True)
        remote = RemoteOptions(url, storage_options=options, compression=kind)
        with CheckpointManager(tmp_path / "b", world_size=2, remote=remote) as reader:
            for step in (1, 2):
                result = reader.restore(step)
                assert result.sources == {0: "remote", 1: "remote"}
                same(result.states[1], trained(step + 10))
            assert reader.verify().ok and len(reader.verify().checks) == 8  # 2 steps x 2 ranks x 2 tiers


@pytest.mark.slow
def test_two_rank_processes_hand_their_compressed_entries_to_the_one_that_commits(tmp_path, s3_url):
    from test_coordination import WORKER, expected_digests

    actions = [{"do": "save", "step": 1}, {"do": "wait"}]
    results = launch_ranks(WORKER, tmp_path, 2, {"actions": actions, "compression": "zstd"}, remote=s3_url)
    assert all("error" not in result for result in results.values()), results
    tier = RemoteTier(*s3_url)
    committed = tier.read_manifest(1)
    assert set(committed.compression) == {record.path for record in committed.manifest.shards}
    shutil.rmtree(tmp_path / "nodes" / "rank-1")  # rank 1's node is replaced
    restored = launch_ranks(WORKER, tmp_path, 2, {"actions": [{"do": "restore"}], "compression": "zstd"}, s3_url)
    assert restored[1]["restored"]["sources"] == {"1": "remote"}
    assert restored[1]["restored"]["digests"] == expected_digests(1, 2, 1)


# -- damage -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["head", "middle", "checksum"])
def test_a_flipped_byte_in_a_compressed_object_is_caught_and_the_next_copy_is_read(
    tmp_path, memory_url, small_frames, where
):
    manifest, tier, committed = compressed_step(tmp_path, *memory_url)
    record = manifest.shard(1)
    stored = committed.compression[record.path]
    index = stored.index(record.size_bytes)
    offset = {"head": 20, "middle": index.offsets[3] + index.sizes[3] // 2, "checksum": stored.size_bytes - 2}[where]
    key = object_key(tier, 3, record)
    data = bytearray(tier.backend.read(key))
    data[offset] ^= 0x10
    tier.backend.fs.pipe_file(key, bytes(data))
    assert record.path in (tier.check_shard(3, record) or "")
    spare = MemoryTier("spare")
    spare.land_shard(3, record, ShardSource(path=tmp_path / "ckpt" / step_dir_name(3) / record.path))
    flip_byte(tmp_path / "ckpt" / step_dir_name(3) / record.path, 100)  # the local copy fails too
    store = TieredStore([LocalTier(tmp_path / "ckpt"), tier, spare])
    with store.local.lock():
        fetched = store.fetch_shard(3, record)
        state, source = fetched.state, fetched.source
        assert source == "spare" and state.arrays["optim/master"].tobytes() == trained(1)["optim"]["master"].tobytes()
        flip_byte(tmp_path / "ckpt" / step_dir_name(3) / record.path, 100)  # damaged again
        with pytest.raises(ChecksumMismatchError, match=f"remote .*{record.path}.zst"):
            store.fetch_shard(3, record, later=["remote"])
    frame = {"head": 0, "middle": 3, "checksum": len(index.sizes) - 1}[where]
    buffer = memoryview(bytearray(index.lengths[frame]))
    with pytest.raises(ChecksumMismatchError, match=f"{record.path}.zst frame {frame}"):
        tier.read_range_into(3, record, index.starts[frame], buffer)


def test_a_shard_damaged_on_local_disk_is_never_compressed_into_the_bucket(tmp_path, memory_url):
    manifest = save_sharded([trained(0)], tmp_path / step_dir_name(1), step=1)
    record = manifest.shard(0)
    flip_byte(tmp_path / step_dir_name(1) / record.path, 5000)
    tier = RemoteTier(*memory_url, compression="zstd")
    with pytest.raises(ChecksumMismatchError, match="before its compression"):
        tier.land_shard(1, record, ShardSource(path=tmp_path / step_dir_name(1) / record.path))
    assert tier.uncommitted_steps() == [] and temp_files(tmp_path / step_dir_name(1)) == []


class Failing(Wrapper):
    """Fails the first ``transient`` shard uploads with a reset connection, then every one with
    ``permanent`` (if set); counts the bytes of every ranged read and every stream opened."""

    def __init__(self, inner, transient=0, permanent=None):
        super().__init__(inner)
        self.transient, self.permanent, self.read_bytes, self.opened = transient, permanent, 0, 0

    def put_shard(self, local_path, path, record, *, deadline):
        assert local_path.name.endswith(".tmp") and ".zst." in local_path.name  # the compressed copy
        if self.transient:
            self.transient -= 1
            raise ConnectionResetError("connection reset by peer (injected)")
        if self.permanent is not None:
            raise self.permanent
        return super().put_shard(local_path, path, record, deadline=deadline)

    def read(self, path, start=None, end=None):
        data = super().read(path, start, end)
        self.read_bytes += len(data) if path.endswith(".zst") else 0
        return data

    def open(self, path):
        self.opened += 1
        return super().open(path)


def test_a_transient_failure_is_retried_and_a_permanent_one_leaves_no_compressed_copy(tmp_path, memory_url, caplog):
    manifest = save_sharded([trained(0)], tmp_path / step_dir_name(1), step=1)
    record, path = manifest.shard(0), tmp_path / step_dir_name(1) / manifest.shard(0).path
    retry = RetryPolicy(max_tries=3, backoff_seconds=0)
    tier = RemoteTier(*memory_url, retry=retry, compression="zstd", wrap=lambda inner: Failing(inner, transient=2))
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        landed = tier.land_shard(1, record, ShardSource(path=path))
    assert landed.sent and temp_files(path.parent) == []
    tier.commit(manifest, landed=[landed])  # what landed says how the object is stored: read it back through it
    assert tier.check_shard(1, record) is None
    refused = PermissionError("access denied (injected)")
    tier = RemoteTier(
        *memory_url, retry=retry, compression="zstd", wrap=lambda inner: Failing(inner, permanent=refused)
    )
    with pytest.raises(RemoteError, match="access denied") as caught:
        tier.land_shard(2, record, ShardSource(path=path))
    assert not caught.value.transient and temp_files(path.parent) == []


class Asking(Wrapper):
    """Records each listing, existence check and ranged read the tier makes."""

    def __init__(self, inner):
        super().__init__(inner)
        self.asked = []

    def list_names(self, prefix):
        self.asked.append(("list", prefix))
        return super().list_names(prefix)

    def exists(self, path):
        self.asked.append(("exists", path))
        return super().exists(path)

    def read(self, path, start=None, end=None):
        self.asked.append(("read", path))
        return super().read(path, start, end)


def test_a_compressed_landing_of_a_steps_shard_asks_the_bucket_nothing_first(tmp_path, memory_url):
    """Looking for a step's own shard before compressing it was a manifest read that found
    nothing, a listing and a check of every committed step: per rank, per save."""
    tier = RemoteTier(*memory_url, compression="zstd", wrap=Asking)
    for step in (1, 2, 3):
        directory = tmp_path / step_dir_name(step)
        manifest = save_sharded([trained(step)], directory, step=step)
        tier.backend.inner.asked.clear()
        landed = tier.land_shard(step, manifest.shard(0), ShardSource(path=directory / manifest.shard(0).path))
        assert landed.sent and tier.backend.inner.asked == [], (step, tier.backend.inner.asked)
        tier.commit(manifest, landed=[landed])
    assert tier.steps() == [1, 2, 3] and tier.check_shard(3, manifest.shard(0)) is None


def test_an_earlier_steps_file_is_looked_up_before_it_is_sent_again(tmp_path, memory_url):
    """A new process (knowing nothing of the bucket, compressing nothing) sends step 1's file as
    the earlier file a later step references: it reads step 1's manifest and finds the
    compressed object, sending nothing."""
    manifest, _tier, committed = compressed_step(tmp_path, *memory_url, step=1, ranks=1)
    record, path = manifest.shard(0), tmp_path / "ckpt" / step_dir_name(1) / manifest.shard(0).path
    tier = RemoteTier(*memory_url, wrap=Asking)
    landed = tier.land_shard(1, record, ShardSource(path=path, earlier=True))
    assert not landed.sent and landed.stored_bytes == committed.compression[record.path].size_bytes
    assert [what for what, _path in tier.backend.inner.asked] == ["read"]  # the manifest, once


def test_a_committed_object_is_never_replaced_by_other_compressed_bytes_of_its_file(tmp_path, memory_url, monkeypatch):
    """A step's shard sent again (a push after its receipt was lost) by a process whose zstd makes
    other bytes of the same file: the committed object, whose frames its manifest records, stays."""
    manifest, _tier, committed = compressed_step(tmp_path, *memory_url, step=1, ranks=1)
    record, path = manifest.shard(0), tmp_path / "ckpt" / step_dir_name(1) / manifest.shard(0).path
    tier = RemoteTier(*memory_url, compression="zstd")
    key = object_key(tier, 1, record)
    before = tier.backend.read(key)
    monkeypatch.setattr(compression, "compress_frames", functools.partial(zstd_frames.compress_frames, level=19))
    landed = tier.land_shard(1, record, ShardSource(path=path))
    assert not landed.sent and tier.backend.read(key) == before
    assert RemoteTier(*memory_url).check_shard(1, record) is None


# -- ranged reads ----------------------------------------------------------------------------


def test_a_partial_read_from_a_compressed_bucket_fetches_only_the_frames_it_needs(tmp_path, memory_url, small_frames):
    manifest, tier, committed = compressed_step(tmp_path, *memory_url)
    url, options = memory_url
    counted = RemoteTier(url, options, wrap=Failing)
    store = TieredStore([LocalTier(tmp_path / "fresh"), counted])
    record = manifest.shard(0)
    with store.local.lock():
        header, source = store.read_shard_header(3, record)  # what `tiered-ckpt show` reads
        assert source == "remote" and counted.backend.inner.read_bytes == committed.compression[record.path].frames[0]
        state, source = store.read_parts(3, record, {"model/norm"})
    assert state.arrays["model/norm"].tobytes() == np.ones(256, np.float32).tobytes() and source == "remote"
    stored = committed.compression[record.path]
    entry = header.arrays["model/norm"]
    covering = stored.index(record.size_bytes).covering(entry.begin, entry.end)
    assert counted.backend.inner.read_bytes == stored.frames[0] + sum(stored.frames[i] for i in covering)
    assert counted.backend.inner.read_bytes < stored.size_bytes / 4 and counted.backend.inner.opened == 0
    assert store.local.steps() == []  # parts of shards are not a local copy


def test_a_partial_restore_and_an_export_from_a_compressed_bucket_are_byte_equal(tmp_path, cloud_url, small_frames):
    from tiered_ckpt import export_safetensors

    url, options = cloud_url
    remote = RemoteOptions(url, storage_options=options, compression="zstd")
    with CheckpointManager(tmp_path / "a", world_size=2, remote=remote) as manager:
        manager.save(4, [trained(0), trained(1)], blocking=True)
    expected = export_safetensors(tmp_path / "a", tmp_path / "from-disk", only="model")
    shutil.rmtree(tmp_path / "a")
    into = [{"optim": {"exp_avg_sq": np.empty(60_000, np.float32)}} for _ in range(2)]
    with CheckpointManager(tmp_path / "b", world_size=2, remote=RemoteOptions(url, storage_options=options)) as b:
        result = b.restore(paths=[("optim", "exp_avg_sq")], into=into)
        assert b.steps() == [] and result.sources == {0: "remote", 1: "remote"}
    for rank in range(2):
        assert into[rank]["optim"]["exp_avg_sq"].tobytes() == trained(rank)["optim"]["exp_avg_sq"].tobytes()
    assert result.bytes_read < sum(record.size_bytes for record in result.manifest.shards) / 3
    exported = export_safetensors(tmp_path / "c", tmp_path / "from-bucket", remote=remote, only="model")
    assert exported.files == expected.files and not (tmp_path / "c").exists()  # the same bytes; nothing written


# -- verify --remote ---------------------------------------------------------------------------


def test_verify_remote_checks_compressed_objects_by_the_stores_checksums_without_a_download(
    tmp_path, cloud_url, monkeypatch
):
    manifest, tier, committed = compressed_step(tmp_path, *cloud_url)
    assert set(committed.store_checksums) == set(committed.compression)
    store = TieredStore([LocalTier(tmp_path / "ckpt"), RemoteTier(*cloud_url)])
    with monkeypatch.context() as patched:
        patched.setattr(RemoteTier, "open_shard", lambda *args: pytest.fail("downloaded"))
        assert survey.verify(store, 3, later_only=True).ok
    record = manifest.shard(0)  # the object replaced behind the library's back: same size, one byte other
    data = bytearray(tier.backend.read(object_key(tier, 3, record)))
    data[len(data) // 2] ^= 0x01
    tier.backend.fs.pipe_file(object_key(tier, 3, record), bytes(data))
    with monkeypatch.context() as patched:
        patched.setattr(RemoteTier, "open_shard", lambda *args: pytest.fail("downloaded"))
        failed = survey.verify(TieredStore([LocalTier(tmp_path / "ckpt"), RemoteTier(*cloud_url)]), 3, later_only=True)
    assert [check.rank for check in failed.failed] == [0] and "checksum" in failed.failed[0].problem
    downloaded = survey.verify(store, 3)  # hashing every copy: the decompressed bytes fail their sha256
    assert [(check.tier, check.rank) for check in downloaded.failed] == [("remote", 0)]


# -- options ---------------------------------------------------------------------------------


def test_compression_is_off_by_default_and_an_unknown_one_is_refused_naming_the_field(memory_url):
    assert RemoteOptions("s3://bucket/run").compression == "none"
    assert RemoteTier(*memory_url).compression == "none"
    with pytest.raises(ConfigError, match="compression must be one of") as caught:
        RemoteOptions("s3://bucket/run", compression="gzip")
    assert caught.value.field == "compression"
    with pytest.raises(ConfigError, match="compression must be one of"):
        RemoteTier(*memory_url, compression="lz4")


def test_without_zstandard_zstd_is_refused_at_construction_and_a_compressed_object_says_what_to_install(
    tmp_path, memory_url, monkeypatch
):
    from tiered_ckpt.errors import UsageError
    from tiered_ckpt.io import zstd_frames

    manifest, _tier, _committed = compressed_step(tmp_path, *memory_url)
    monkeypatch.setattr(zstd_frames, "_zstandard", lambda: (_ for _ in ()).throw(UsageError("zstd: pip install x")))
    with pytest.raises(ConfigError, match=r"zstandard package: pip install 'tiered-ckpt\[zstd\]'"):
        RemoteOptions("s3://bucket/run", compression="zstd")
    with pytest.raises(UsageError, match="pip install"):
        RemoteTier(*memory_url).read_range_into(3, manifest.shard(0), 0, memoryview(bytearray(8)))


def test_the_remote_manifest_of_a_compressed_step_names_each_object_once(tmp_path, memory_url):
    manifest, tier, committed = compressed_step(tmp_path, *memory_url)
    names = sorted(path.rsplit("/", 1)[-1] for path in tier.backend.find(f"{tier.backend.root}/{step_dir_name(3)}"))
    assert names == sorted([MANIFEST_NAME, *(f"{record.path}.zst" for record in manifest.shards)])
    assert tier.shard_location(3, manifest.shard(0)).endswith(".safetensors.zst")
    assert committed == tier.read_manifest(3)


def test_the_hashed_layout_spreads_compressed_objects_and_a_reader_finds_them(tmp_path, memory_url):
    url, options = memory_url
    manifest = save_sharded([trained(0), trained(1)], tmp_path / "ckpt" / step_dir_name(3), step=3)
    tier = RemoteTier(url, options, layout="hashed", compression="zstd")
    landed = [
        tier.land_shard(3, record, ShardSource(path=tmp_path / "ckpt" / step_dir_name(3) / record.path))
        for record in manifest.shards
    ]
    committed = tier.commit(manifest, landed=landed)
    reader = RemoteTier(url, options)  # flat and uncompressed by its own options
    for record in manifest.shards:
        name = committed.locations[record.path]
        assert name.endswith(record.path) and name != record.path
        assert tier.backend.exists(f"{tier.backend.root}/{step_dir_name(3)}/{name}.zst")
        assert reader.check_shard(3, record) is None


def test_credentials_never_appear_in_what_a_compressed_tier_logs_records_or_raises(tmp_path, s3_url, caplog):
    from tiered_ckpt import IncompleteCheckpointError

    url, options = s3_url
    caplog.set_level(logging.DEBUG)
    manifest, tier, committed = compressed_step(tmp_path, url, options)
    record = manifest.shard(0)
    tier.backend.fs.pipe_file(object_key(tier, 3, record), tier.backend.read(object_key(tier, 3, record))[:-10])
    seen = [repr(tier), committed.to_json(), tier.check_shard(3, record) or "no problem found"]
    stored = committed.compression[record.path]
    index = stored.index(record.size_bytes)
    with pytest.raises(IncompleteCheckpointError, match="shorter") as caught:
        tier.read_range_into(3, record, index.starts[-2], memoryview(bytearray(index.lengths[-1])))
    seen += [str(caught.value), repr(caught.value)]
    seen += [each.getMessage() for each in caplog.records if each.name.startswith("tiered_ckpt")]
    assert "no problem found" not in seen and record.path in seen[2]
    assert not [text for text in seen if options["secret"] in text or options["key"] in text]
