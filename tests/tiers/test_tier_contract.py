"""The tier contract (tiered_ckpt/testing/tier.py) on each tier: memory here; each real tier's tests subclass it too."""

import io

import pytest

from support.memory_tier import MemoryTier
from tiered_ckpt.format.compressed import SUFFIX
from tiered_ckpt.format.layout import MANIFEST_NAME, step_dir_name
from tiered_ckpt.io.zstd_frames import compress_frames, frame_lengths
from tiered_ckpt.testing.tier import TierContract
from tiered_ckpt.tiers.remote.compression import FRAME_BYTES
from tiered_ckpt.tiers.remote.tier import RemoteTier, RetryPolicy


class TestMemoryTier(TierContract):
    @pytest.fixture
    def tier(self):
        return MemoryTier()

    def replace_shard(self, tier, step, record, data):
        tier.shards[(step, record.path)] = data

    def replace_manifest(self, tier, step, data):
        tier.manifests[step] = data

    @pytest.mark.parametrize("shared", [False, True])
    def test_a_node_local_tier_holds_the_ranks_that_landed_here_a_shared_one_every_rank(self, shared):
        tier = MemoryTier(shared=shared)
        manifest = self.commit_step(tier, 3)
        del tier.shards[(3, manifest.shards[0].path)]  # this node's part: rank 0's shard is on another node
        assert tier.held_ranks(3, manifest) == ((0, 1) if shared else (1,))


class TestSharedMemoryTier(TierContract):
    """The memory tier over a directory every process shares (standing for Redis, see tests/test_extra_tiers.py)."""

    @pytest.fixture
    def tier(self, tmp_path):
        return MemoryTier("redis", shared=True, directory=tmp_path / "redis")

    def replace_shard(self, tier, step, record, data):
        tier.shards[(step, record.path)] = data

    def replace_manifest(self, tier, step, data):
        tier.manifests[step] = data

    def test_every_tier_over_one_directory_holds_the_same_steps(self, tier, tmp_path):
        manifest = self.commit_step(tier, 5)
        other = MemoryTier("redis", shared=True, directory=tmp_path / "redis")  # another process's view
        assert other.steps() == [5] and other.manifest(5) == manifest
        other.delete_step(5)
        assert tier.steps() == [] and tier.uncommitted_steps() == []


class RemoteTierContract(TierContract):
    """The object-store tier, on each backend (the ``url`` fixture names one)."""

    @pytest.fixture
    def tier(self, url):
        return RemoteTier(*url, retry=RetryPolicy(max_tries=2, backoff_seconds=0))

    def _object(self, tier, step, name):
        return f"{tier.backend.root}/{step_dir_name(step)}/{name}"

    def replace_shard(self, tier, step, record, data):
        tier.backend.fs.pipe_file(self._object(tier, step, tier.object_name(step, record.path)), data)

    def replace_manifest(self, tier, step, data):
        tier.backend.fs.pipe_file(self._object(tier, step, MANIFEST_NAME), data)


class TestRemoteTierOnMemory(RemoteTierContract):
    @pytest.fixture
    def url(self, memory_url):
        return memory_url


class TestRemoteTierOnFile(RemoteTierContract):
    @pytest.fixture
    def url(self, file_url):
        return file_url


class TestRemoteTierOnS3(RemoteTierContract):
    @pytest.fixture
    def url(self, s3_url):
        return s3_url


class TestRemoteTierOnGcs(RemoteTierContract):
    @pytest.fixture
    def url(self, gcs_url):
        return gcs_url


class TestRemoteTierOnAzure(RemoteTierContract):
    @pytest.fixture
    def url(self, azure_url):
        return azure_url


class CompressedRemoteTierContract(RemoteTierContract):
    """The object-store tier compressing what it puts (``compression="zstd"``), on each backend."""

    @pytest.fixture
    def tier(self, url):
        return RemoteTier(*url, retry=RetryPolicy(max_tries=2, backoff_seconds=0), compression="zstd")

    def replace_shard(self, tier, step, record, data):
        """``data`` compressed as the tier compresses, put where the tier keeps the shard's object."""
        out = io.BytesIO()
        compress_frames(io.BytesIO(data), out, frame_lengths(len(data), FRAME_BYTES, FRAME_BYTES))
        name = tier.object_name(step, record.path) + SUFFIX
        tier.backend.fs.pipe_file(self._object(tier, step, name), out.getvalue())


class TestCompressedRemoteTierOnMemory(CompressedRemoteTierContract):
    @pytest.fixture
    def url(self, memory_url):
        return memory_url


class TestCompressedRemoteTierOnFile(CompressedRemoteTierContract):
    @pytest.fixture
    def url(self, file_url):
        return file_url


class TestCompressedRemoteTierOnS3(CompressedRemoteTierContract):
    @pytest.fixture
    def url(self, s3_url):
        return s3_url


class TestCompressedRemoteTierOnGcs(CompressedRemoteTierContract):
    @pytest.fixture
    def url(self, gcs_url):
        return gcs_url


class TestLocalTier(TierContract):
    @pytest.fixture
    def tier(self, tmp_path):
        from tiered_ckpt.tiers.local import LocalTier

        tier = LocalTier(tmp_path / "local")
        with tier.lock():
            yield tier

    def replace_shard(self, tier, step, record, data):
        tier.shard_path(step, record).write_bytes(data)

    def replace_manifest(self, tier, step, data):
        from tiered_ckpt.format.layout import MANIFEST_NAME

        (tier.step_dir(step) / MANIFEST_NAME).write_bytes(data)


class TestCompressedRemoteTierOnAzure(CompressedRemoteTierContract):
    @pytest.fixture
    def url(self, azure_url):
        return azure_url
