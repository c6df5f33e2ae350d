"""The backends behind the object-store tier (tiered_ckpt.tiers.remote.backends), on the real stores:
one chosen per protocol, what each says it can do, the checksums each computes, and the
wrappers around them."""

from dataclasses import replace

import numpy as np
import pytest

from tiered_ckpt import RemoteError, save_sharded
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.testing.backend import BackendContract
from tiered_ckpt.testing.tier import manifest_of, shard_bytes, writing
from tiered_ckpt.tiers.base import Capabilities, ShardSource, Tier
from tiered_ckpt.tiers.remote.backends import open_backend
from tiered_ckpt.tiers.remote.backends.azure import AzureBackend
from tiered_ckpt.tiers.remote.backends.base import Backend
from tiered_ckpt.tiers.remote.backends.fsspec import FsspecBackend
from tiered_ckpt.tiers.remote.backends.gcs import GcsBackend
from tiered_ckpt.tiers.remote.backends.posix import PosixBackend
from tiered_ckpt.tiers.remote.backends.s3 import S3Backend, same_checksum
from tiered_ckpt.tiers.remote.backends.wrappers import Counting, Wrapper
from tiered_ckpt.tiers.remote.tier import RemoteTier, RetryPolicy

EXPECTED = {  # protocol fixture -> (backend, atomic create-only commits, store checksums, bucket's scheme)
    "memory": (FsspecBackend, False, False, None),
    "file": (PosixBackend, True, False, None),
    "s3": (S3Backend, True, True, "s3"),
    "gcs": (GcsBackend, True, True, "gs"),
    "azure": (AzureBackend, True, True, "az"),
}


def shard(tmp_path, size=300_000, step=4):
    states = [{"w": np.random.default_rng(step).integers(0, 255, size, dtype=np.uint8)}]
    manifest = save_sharded(states, tmp_path / "local" / step_dir_name(step), step=step)
    return manifest, tmp_path / "local" / step_dir_name(step) / manifest.shard(0).path


@pytest.mark.parametrize("store", sorted(EXPECTED))
def test_each_protocol_gets_its_backend_and_the_tier_says_what_it_can_do(store, request):
    url, options = request.getfixturevalue(f"{store}_url")
    tier = RemoteTier(url, options)
    kind, create_only, checksums, scheme = EXPECTED[store]
    assert isinstance(tier, Tier) and isinstance(tier.backend, Backend) and type(tier.backend.inner) is kind
    assert tier.name == "remote"
    assert tier.capabilities == Capabilities(
        durable=True,
        shared=True,
        create_only_commit=create_only,
        store_checksums=checksums,
        ranged_reads=True,
        receipts=True,
        leases=True,
        latest=True,
        retries=True,
        references=True,
        confirms=True,
    )
    assert tier.backend.keeps_metadata is checksums
    assert tier.capabilities == replace(
        tier.backend.capabilities,
        receipts=True,
        leases=True,
        latest=True,
        retries=True,
        references=True,
        confirms=True,
    )
    bucket = tier.backend.bucket
    assert bucket == (None if scheme is None else f"{scheme}://{url.split('://')[1].split('/')[0]}")
    tier.check_bucket()  # exists (or there is none to check)


def test_a_plain_path_is_a_file_system(tmp_path):
    backend = open_backend(str(tmp_path / "bucket"), {}, retry=RetryPolicy(), part_bytes=1 << 20, part_concurrency=1)
    assert isinstance(backend, PosixBackend) and backend.root == str(tmp_path / "bucket")


def test_a_url_fsspec_cannot_open_is_a_remote_error_that_never_says_the_options():
    with pytest.raises(RemoteError, match="cannot open nosuchprotocol://b/run") as caught:
        RemoteTier("nosuchprotocol://b/run", {"secret_access_key": "hunter2-secret"})
    assert "hunter2" not in str(caught.value) and not caught.value.transient


@pytest.mark.parametrize("store", ["s3", "gcs", "azure"])
def test_the_checksums_a_backend_computes_are_the_ones_its_store_keeps(store, request, tmp_path):
    url, options = request.getfixturevalue(f"{store}_url")
    tier = RemoteTier(url, options)
    manifest, path = shard(tmp_path)
    record = manifest.shard(0)
    landed = tier.land_shard(4, record, ShardSource(path=path))
    assert landed.sent
    expected = tier.backend.sums(path, record)
    head = tier.backend.head(f"{tier.backend.root}/{step_dir_name(4)}/{record.path}")
    assert head.size == record.size_bytes and head.sha256 == record.sha256
    assert tier.backend.store_problem(head, expected) is None
    algorithm = "md5" if store == "azure" else "crc32c"  # Azure keeps no CRC of a blob
    assert expected.kept.startswith(f"{algorithm}:") and tier.backend.kept_checksum(head, "sha256") is None
    assert same_checksum(tier.backend.kept_checksum(head, algorithm), expected.kept)
    assert landed.checksum == expected.kept


@pytest.mark.parametrize("store", ["memory", "file"])
def test_a_store_without_checksums_or_metadata_has_none_to_compare(store, request, tmp_path):
    url, options = request.getfixturevalue(f"{store}_url")
    tier = RemoteTier(url, options)
    manifest, path = shard(tmp_path)
    record = manifest.shard(0)
    assert tier.backend.sums(path, record) is None
    landed = tier.land_shard(4, record, ShardSource(path=path))
    assert landed.sent
    head = tier.backend.head(f"{tier.backend.root}/{step_dir_name(4)}/{record.path}")
    assert head.size == record.size_bytes and head.sha256 is None
    assert landed.checksum is None and tier.backend.open_uploads() == []


def test_counting_counts_every_request_of_a_multipart_upload(s3_url, tmp_path):
    url, options = s3_url
    tier = RemoteTier(url, options, part_bytes=5 << 20)
    manifest, path = shard(tmp_path, 11 << 20)
    assert tier.land_shard(4, manifest.shard(0), ShardSource(path=path)).sent
    # CreateMultipartUpload, 3 parts, CompleteMultipartUpload; none throttled.
    assert isinstance(tier.backend, Counting) and (tier.backend.requests, tier.backend.throttled) == (5, 0)
    assert not tier.land_shard(4, manifest.shard(0), ShardSource(path=path)).sent  # intact: nothing sent
    assert tier.backend.requests == 5


class Recording(Wrapper):
    """Records the objects it is asked to put, and fails the first put of each."""

    def __init__(self, inner):
        super().__init__(inner)
        self.puts = []

    def put_shard(self, local_path, path, record, *, deadline):
        self.puts.append(path.rsplit("/", 1)[-1])
        if len(self.puts) == 1:
            raise ConnectionResetError("reset by peer (injected)")
        return super().put_shard(local_path, path, record, deadline=deadline)


def test_a_wrapper_sees_the_tiers_calls_and_its_faults_are_retried(memory_url, tmp_path):
    url, options = memory_url
    tier = RemoteTier(url, options, retry=RetryPolicy(max_tries=3, backoff_seconds=0), wrap=Recording)
    manifest, path = shard(tmp_path)
    record = manifest.shard(0)
    landed = tier.land_shard(4, record, ShardSource(path=path))
    assert landed.sent
    assert tier.backend.inner.puts == [record.path, record.path]  # the reset, then the put that went through
    assert tier.backend.requests == 1  # Counting stays outermost: what reached the store
    tier.commit(manifest, landed=[landed])
    assert tier.steps() == [4] and tier.check_shard(4, record) is None
    assert repr(tier.backend) == f"Counting(Recording(FsspecBackend({url!r})))"


def test_a_file_system_writes_small_objects_create_only_and_deletes_a_step_whole(file_url):
    url, options = file_url
    backend = open_backend(url, options, retry=RetryPolicy(), part_bytes=1 << 20, part_concurrency=1)
    path = f"{backend.root}/{step_dir_name(1)}/deep/manifest.json"
    backend.put_bytes(path, b"first", create_only=True)  # parents created
    with pytest.raises(FileExistsError):
        backend.put_bytes(path, b"second", create_only=True)
    assert backend.read(path) == b"first" and backend.find(f"{backend.root}/{step_dir_name(1)}") == [path]
    backend.delete_prefix(f"{backend.root}/{step_dir_name(1)}")
    assert not backend.exists(path) and backend.list_names(backend.root) == []


def test_the_generic_backend_claims_no_create_only_commit_as_fsspec_checks_then_writes(memory_url):
    url, options = memory_url
    backend = open_backend(url, options, retry=RetryPolicy(), part_bytes=1 << 20, part_concurrency=1)
    assert type(backend) is FsspecBackend and not backend.capabilities.create_only_commit
    path = f"{backend.root}/{step_dir_name(3)}/manifest.json"
    checked, answers = backend.fs.exists, []

    def checked_before_another_writer_lands(name):  # its create lands after the checks, before the write
        if not answers:
            answers.append(checked(name))
            backend.fs.pipe_file(path, b"the other writer's commit")
        return answers[0]

    backend.fs.exists = checked_before_another_writer_lands
    backend.put_bytes(path, b"this commit", create_only=True)  # no FileExistsError: it replaced the other
    del backend.fs.exists
    assert answers == [False] and backend.read(path) == b"this commit"


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_the_generic_backend_still_refuses_a_second_commit_of_a_committed_step(memory_url, compression):
    # What guards it instead of an atomic create: fsspec's check before the write (and the run
    # leases, which report, or with other_owners="refuse" refuse, a second live run on the URL).
    tier = RemoteTier(*memory_url, retry=RetryPolicy(max_tries=2, backoff_seconds=0), compression=compression)
    first = manifest_of(6)
    landed = [tier.land_shard(6, record, writing(shard_bytes(6, record.rank))) for record in first.shards]
    tier.commit(first, landed=landed)
    other = manifest_of(6, [b"other" * 100, b"bytes" * 100])
    datas = (b"other" * 100, b"bytes" * 100)
    with pytest.raises(RemoteError, match="a different checkpoint of step 6 is already committed"):
        tier.land_shard(6, other.shards[0], writing(datas[0]))  # refused before its object is replaced
    with pytest.raises(RemoteError, match="a different checkpoint of step 6 is already committed"):
        tier.commit(other, landed=[])
    assert tier.manifest(6).shards == first.shards
    assert all(tier.check_shard(6, record) is None for record in first.shards)


def test_memory_forgets_the_directories_of_a_deleted_step(memory_url):
    url, options = memory_url
    backend = open_backend(url, options, retry=RetryPolicy(), part_bytes=1 << 20, part_concurrency=1)
    backend.put_bytes(f"{backend.root}/{step_dir_name(2)}/ab/rank.safetensors", b"x")
    backend.delete_prefix(f"{backend.root}/{step_dir_name(2)}")
    assert backend.list_names(backend.root) == []


def test_a_stores_checksum_matches_with_or_without_the_part_count_and_nothing_else():
    assert same_checksum("crc32c:qg7Tjw==-3", "crc32c:qg7Tjw==-3")
    assert same_checksum("crc32c:qg7Tjw==", "crc32c:qg7Tjw==-3")  # moto's HEAD leaves "-3" off
    assert not same_checksum("crc32c:qg7Tjw==", "crc32c:qg7Tjx==-3")
    assert not same_checksum("crc32c:qg7Tjw==-4", "crc32c:qg7Tjw==-3")
    assert not same_checksum("", "crc32c:qg7Tjw==") and not same_checksum(None, "crc32c:qg7Tjw==")
    assert not same_checksum("", "-")  # no part count to leave off


@pytest.mark.parametrize(("given", "pooled"), [(None, 32), (5, 5)])
def test_an_s3_client_pools_twice_part_concurrency_connections_unless_told(s3_url, given, pooled):
    url, options = s3_url
    if given is not None:
        options = {**options, "config_kwargs": {"max_pool_connections": given}}
    backend = open_backend(url, options, retry=RetryPolicy(), part_bytes=5 << 20, part_concurrency=16)
    backend.check_bucket()  # the client is made at the first request
    assert backend.fs.s3.meta.config.max_pool_connections == pooled


class OpenedBackendContract(BackendContract):
    """The backend contract (tiered_ckpt/testing/backend.py) on the backend each URL opens (``url`` fixture)."""

    @pytest.fixture
    def backend(self, url):
        return open_backend(*url, retry=RetryPolicy(), part_bytes=5 << 20, part_concurrency=2)


class TestFsspecBackendOnMemory(OpenedBackendContract):
    @pytest.fixture
    def url(self, memory_url):
        return memory_url


class TestPosixBackend(OpenedBackendContract):
    @pytest.fixture
    def url(self, file_url):
        return file_url


class TestS3Backend(OpenedBackendContract):
    @pytest.fixture
    def url(self, s3_url):
        return s3_url


class TestGcsBackend(OpenedBackendContract):
    @pytest.fixture
    def url(self, gcs_url):
        return gcs_url


class TestAzureBackend(OpenedBackendContract):
    @pytest.fixture
    def url(self, azure_url):
        return azure_url
