import dataclasses
import errno
import io
import os
import threading
from concurrent.futures import Future

import numpy as np
import pytest

from support.states import flip_byte
from support.stores import REMOTES, with_slow
from tiered_ckpt import (
    CheckpointManager,
    ChecksumMismatchError,
    ManifestError,
    RemoteError,
    RemoteOptions,
    UploadError,
    UploadOptions,
    save_sharded,
)
from tiered_ckpt.format.layout import MANIFEST_NAME, step_dir_name
from tiered_ckpt.io.hashing import hash_stream
from tiered_ckpt.tiers import pruning
from tiered_ckpt.tiers.base import ShardSource
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote import tier as tier_module
from tiered_ckpt.tiers.remote.tier import RemoteTier, RetryPolicy, is_transient
from tiered_ckpt.tiers.retention import RetentionPolicy
from tiered_ckpt.tiers.store import TieredStore


@pytest.fixture
def saved(tmp_path):
    states = [{"w": np.arange(1000, dtype=np.float32) + rank} for rank in range(2)]
    manifest = save_sharded(states, tmp_path / "local", step=3)
    return tmp_path / "local", manifest


@pytest.fixture
def tier(remote_url):
    url, options = remote_url
    return RemoteTier(url, options)


def upload_all(tier, directory, manifest):
    """Land every shard of ``manifest`` (each put: none was there); what landed, for the commit."""
    landed = [
        tier.land_shard(manifest.step, record, ShardSource(path=directory / record.path)) for record in manifest.shards
    ]
    assert all(each.sent for each in landed)
    return landed


def download(tier, step, record, root):
    """Stream a shard into a step of a local tier at ``root`` through the store, as a restore does."""
    store = TieredStore([LocalTier(root), tier])
    with store.local.lock():
        store.local.new_step_dir(step)
        store.download_shard(step, record)
    return store.local.shard_path(step, record)


def test_upload_confirm_commit_download_delete(tier, saved, tmp_path):
    directory, manifest = saved
    landed = upload_all(tier, directory, manifest)
    assert all(tier.check_shard(3, record) is None for record in manifest.shards)
    assert tier.uncommitted_steps() == [3] and tier.steps() == []
    remote = tier.commit(manifest, landed=landed)
    assert tier.steps() == [3] and tier.uncommitted_steps() == []
    assert tier.read_manifest(3) == remote and remote.manifest == manifest
    target = download(tier, 3, manifest.shard(1), tmp_path / "downloaded")
    assert target.read_bytes() == (directory / manifest.shard(1).path).read_bytes()
    tier.delete_step(3)
    assert tier.steps() == [] and tier.uncommitted_steps() == []


def test_a_remote_manifest_is_read_in_one_request_and_refused_past_its_limit(tier, saved, monkeypatch):
    directory, manifest = saved
    tier.commit(manifest, landed=upload_all(tier, directory, manifest))
    calls = []
    for name in ("head", "size", "exists", "read", "open"):
        method = getattr(tier.backend, name)
        setattr(
            tier.backend,
            name,
            lambda *args, _method=method, _name=name, **kw: (calls.append(_name), _method(*args, **kw))[1],
        )
    assert tier.read_manifest(3).manifest == manifest
    assert calls == ["read"]  # no HEAD for its size first: a restore waits for each request in turn
    size = len(tier.backend.read(tier._path(3, MANIFEST_NAME)))
    monkeypatch.setattr(tier_module, "MAX_MANIFEST_BYTES", size - 1)
    with pytest.raises(ManifestError, match=f"{MANIFEST_NAME}: over the {size - 1} bytes"):
        tier.read_manifest(3)


def test_an_empty_remote_manifest_is_refused_as_one(tier, saved):
    directory, manifest = saved
    tier.commit(manifest, landed=upload_all(tier, directory, manifest))
    tier.backend.put_bytes(tier._path(3, MANIFEST_NAME), b"")
    with pytest.raises(ManifestError, match=MANIFEST_NAME):
        tier.read_manifest(3)


def test_a_listing_checks_its_steps_manifests_at_once(memory_url, tmp_path):
    """Two checks of a listing's steps meet inside the store: one after another, neither would return."""
    url, options = memory_url
    tier = RemoteTier(url, options)
    for step in range(1, 6):
        tier.backend.put_bytes(tier._path(step, "rank-00000-of-00001.safetensors"), b"x")
    meeting, exists = threading.Barrier(2, timeout=60), tier.backend.exists

    def meet(path):
        if path.endswith(MANIFEST_NAME) and any(f"/{step_dir_name(step)}/" in path for step in (1, 2)):
            meeting.wait()  # for the other step's check
        return exists(path)

    tier.backend.exists = meet
    assert tier.uncommitted_steps() == [1, 2, 3, 4, 5]


def test_a_listing_expecting_nothing_reads_no_manifest(remote_url, saved):
    directory, manifest = saved
    writer = RemoteTier(*remote_url)
    writer.commit(manifest, landed=upload_all(writer, directory, manifest))
    tier = RemoteTier(*remote_url)
    calls = []
    for name in ("exists", "read"):
        method = getattr(tier.backend, name)
        setattr(
            tier.backend, name, lambda path, *a, _m=method, _n=name, **kw: (calls.append(_n), _m(path, *a, **kw))[1]
        )
    assert tier.list_steps() == ([3], [])
    assert calls == ["exists"]  # a status, a retention pass: a HEAD, not a manifest that grows with the ranks
    assert tier.take_expected(3) is None


def test_a_listing_expecting_a_step_reads_its_manifest_beside_the_listing(remote_url, saved):
    directory, manifest = saved
    RemoteTier(*remote_url).commit(manifest, landed=upload_all(RemoteTier(*remote_url), directory, manifest))
    tier = RemoteTier(*remote_url)
    calls, read_done = [], threading.Event()
    list_names, read = tier.backend.list_names, tier.backend.read

    def listing(prefix):
        met = read_done.wait(timeout=60)  # one after the other, the read would come after this returned
        calls.append(("list", met))
        return list_names(prefix)

    def reading(path, *args, **kwargs):
        try:
            return read(path, *args, **kwargs)
        finally:  # found or not
            calls.append(("read", path))
            read_done.set()

    tier.backend.list_names, tier.backend.read = listing, reading
    assert tier.list_steps(expect=3) == ([3], [])
    assert calls == [("read", tier._path(3, MANIFEST_NAME)), ("list", True)]  # it stood for step 3's check
    assert tier.take_expected(2) is None  # handed over only as the step it is, and once
    assert tier.list_steps(expect=3) == ([3], [])
    assert tier.take_expected(3).manifest == manifest and tier.take_expected(3) is None
    calls.clear()
    read_done.clear()
    assert tier.list_steps(expect=5) == ([3], [])  # not listed: step 3 is checked as usual
    assert calls == [("read", tier._path(5, MANIFEST_NAME)), ("list", True)]
    assert tier.take_expected(5) is None


def test_a_listing_that_fails_does_not_wait_for_its_guess(memory_url):
    tier = RemoteTier(*memory_url, retry=RetryPolicy(max_tries=1, backoff_seconds=0))
    released, started, reads = threading.Event(), threading.Event(), []

    def hanging_read(path, *args, **kwargs):  # a bucket that hangs: this read answers only when the test ends
        reads.append(path)
        started.set()
        released.wait(timeout=120)
        raise TimeoutError("read timed out (injected)")

    def refused_listing(prefix):
        started.wait(timeout=60)  # the guess is on its way
        raise ConnectionRefusedError("refused (injected)")

    tier.backend.read, tier.backend.list_names = hanging_read, refused_listing
    outcome = []
    listing = threading.Thread(
        target=lambda: outcome.append(pytest.raises(RemoteError, tier.list_steps, once=True, expect=3))
    )
    listing.start()
    listing.join(timeout=60)
    try:
        assert not listing.is_alive() and outcome and outcome[0].value.transient  # while the read still hangs
        assert not released.is_set() and reads == [tier._path(3, MANIFEST_NAME)]
    finally:
        released.set()


def test_threads_looking_up_one_steps_copies_read_its_manifest_once(memory_url, tmp_path):
    """The manifest grows with the ranks: one process's threads wait for one read of it."""
    url, options = memory_url
    writer = RemoteTier(url, options)
    manifest = save_sharded([{"w": np.full(8, rank, np.float32)} for rank in range(2)], tmp_path / "s", step=1)
    landed = [writer.land_shard(1, r, ShardSource(path=tmp_path / "s" / r.path)) for r in manifest.shards]
    writer.commit(manifest, landed=landed)
    tier = RemoteTier(url, options)
    reading, release, reads = threading.Event(), threading.Event(), []
    read = tier.backend.read

    def held_read(path, *args, **kwargs):
        reads.append(path)
        reading.set()
        release.wait(timeout=60)
        return read(path, *args, **kwargs)

    tier.backend.read = held_read
    first = threading.Thread(target=tier.look_up, args=(1, manifest.shard(0)))
    second = threading.Thread(target=tier.look_up, args=(1, manifest.shard(1)))
    first.start()
    assert reading.wait(timeout=60)
    second.start()
    second.join(timeout=1)  # without the lock it reads at once; with it, it waits for the first
    release.set()
    first.join(timeout=60)
    second.join(timeout=60)
    assert reads == [tier._path(1, MANIFEST_NAME)]
    assert tier.shard_location(1, manifest.shard(1)) == f"{url}/{step_dir_name(1)}/{manifest.shard(1).path}"


def test_threads_looking_up_one_step_share_its_failure(memory_url, tmp_path, monkeypatch):
    """A bucket failing every read: the threads waiting for one look-up fail with it, not each
    after a retry policy's tries of its own, one after another."""
    manifest = save_sharded([{"w": np.full(8, rank, np.float32)} for rank in range(3)], tmp_path / "s", step=1)
    writer = RemoteTier(*memory_url)
    writer.commit(
        manifest, landed=[writer.land_shard(1, r, ShardSource(path=tmp_path / "s" / r.path)) for r in manifest.shards]
    )
    tier = RemoteTier(*memory_url, retry=RetryPolicy(max_tries=2, backoff_seconds=0))
    waiting, release, reads = threading.Semaphore(0), threading.Event(), []

    class Awaited(Future):  # counts the threads waiting for another's look-up
        def result(self, timeout=None):
            waiting.release()
            return super().result(timeout)

    def failing_read(path, *args, **kwargs):
        import traceback

        reads.append((threading.get_ident(), "".join(traceback.format_stack(limit=12))))
        release.wait(timeout=60)
        raise ConnectionResetError("connection reset by peer (injected)")

    monkeypatch.setattr(tier_module, "Future", Awaited)
    tier.backend.read = failing_read
    failures = []

    def look_up(record):
        try:
            tier.look_up(1, record)
        except RemoteError as exc:
            failures.append(exc)

    threads = [threading.Thread(target=look_up, args=(record,)) for record in manifest.shards]
    threads[0].start()
    while not reads:
        threads[0].join(timeout=0.01)
    for thread in threads[1:]:
        thread.start()
    assert waiting.acquire(timeout=60) and waiting.acquire(timeout=60)
    release.set()
    for thread in threads:
        thread.join(timeout=60)
    assert len(reads) == 2 and len(failures) == 3  # the first thread's two tries, for all three


def test_commit_is_create_only(tier, saved, tmp_path):
    directory, manifest = saved
    landed = upload_all(tier, directory, manifest)
    first = tier.commit(manifest, landed=landed)
    assert tier.commit(manifest, landed=landed) == first  # a retried commit of the same shards
    other = save_sharded([{"w": np.zeros(3)}, {"w": np.ones(3)}], tmp_path / "other", step=3)
    with pytest.raises(RemoteError, match="a different checkpoint of step 3 is already committed") as caught:
        tier.commit(other)
    assert not caught.value.transient
    assert tier.read_manifest(3) == first


def test_a_changed_object_is_not_taken_as_uploaded(tier, saved):
    directory, manifest = saved
    upload_all(tier, directory, manifest)
    record = manifest.shard(0)
    tier.backend.fs.pipe_file(f"{tier.backend.root}/step-000000000003/{record.path}", b"short")
    assert tier.check_shard(3, record) is not None
    assert tier.land_shard(3, record, ShardSource(path=directory / record.path)).sent  # put again, not skipped
    assert tier.check_shard(3, record) is None
    assert not tier.land_shard(3, record, ShardSource(path=directory / record.path)).sent  # intact: not sent again


def test_download_of_a_corrupted_object_fails_and_leaves_no_file(tier, saved, tmp_path):
    directory, manifest = saved
    record = manifest.shard(1)
    flip_byte(directory / record.path, 200)  # upload a corrupted copy under the recorded size
    tier.backend.fs.makedirs(f"{tier.backend.root}/step-000000000003", exist_ok=True)  # a no-op on object stores
    for each in manifest.shards:
        tier.backend.fs.put_file(str(directory / each.path), f"{tier.backend.root}/step-000000000003/{each.path}")
    with pytest.raises(ChecksumMismatchError, match=f"rank 1 shard .*{record.path}: sha256 is"):
        download(tier, 3, record, tmp_path / "downloaded")
    assert os.listdir(tmp_path / "downloaded" / "step-000000000003") == []  # no shard, no temp file


def test_remote_manifest_is_parsed_strictly(tier, saved):
    directory, manifest = saved
    tier.commit(manifest, landed=upload_all(tier, directory, manifest))
    path = f"{tier.backend.root}/step-000000000003/{MANIFEST_NAME}"
    tier.backend.fs.pipe_file(path, manifest.to_json().encode())  # a local manifest is not a remote one
    with pytest.raises(ManifestError, match="field 'kind'"):
        tier.read_manifest(3)


def test_missing_bucket_is_a_permanent_remote_error(moto_endpoint, saved):
    from support.stores import s3_storage_options

    tier = RemoteTier("s3://tiered-no-such-bucket/run", s3_storage_options(moto_endpoint))
    directory, manifest = saved
    with pytest.raises(RemoteError, match="permanent") as caught:
        tier.land_shard(3, manifest.shard(0), ShardSource(path=directory / manifest.shard(0).path))
    assert not caught.value.transient
    assert isinstance(caught.value.__cause__, FileNotFoundError)


def test_sha256_is_kept_as_object_metadata_on_s3(s3_url, saved):
    import s3fs

    url, options = s3_url
    tier = RemoteTier(url, options)
    directory, manifest = saved
    upload_all(tier, directory, manifest)
    fs = s3fs.S3FileSystem(**options)
    stored = fs.metadata(f"{url.removeprefix('s3://')}/step-000000000003/{manifest.shard(0).path}")
    assert stored["sha256"] == manifest.shard(0).sha256


def test_repr_and_errors_never_show_storage_options(s3_url):
    url, options = s3_url
    tier = RemoteTier(url, options)
    assert options["secret"] not in repr(tier) and options["key"] not in repr(tier)


@pytest.mark.parametrize(
    "exc, transient",
    [
        (OSError(errno.EBUSY, "SlowDown"), True),
        (OSError(errno.EREMOTEIO, "InternalError"), True),
        (TimeoutError("read timed out"), True),
        (ConnectionResetError("reset by peer"), True),
        (OSError("An error occurred (503) Service Unavailable"), True),
        (PermissionError("AccessDenied"), False),
        (FileNotFoundError("NoSuchBucket"), False),
        (OSError(errno.EINVAL, "InvalidArgument"), False),
        (ValueError("bad"), False),
    ],
)
def test_transient_errors_are_told_from_permanent_ones(exc, transient):
    assert is_transient(exc) is transient


def test_sha256_is_kept_as_object_metadata_on_gcs(gcs_url, saved):
    import gcsfs

    url, options = gcs_url
    tier = RemoteTier(url, options)
    directory, manifest = saved
    upload_all(tier, directory, manifest)
    info = gcsfs.GCSFileSystem(**options).info(
        f"{url.removeprefix('gs://')}/step-000000000003/{manifest.shard(1).path}"
    )
    assert info["metadata"]["sha256"] == manifest.shard(1).sha256


def test_a_url_or_option_fsspec_cannot_use_is_a_permanent_remote_error():
    with pytest.raises(RemoteError, match="cannot open nosuch://bucket/run") as caught:
        RemoteTier("nosuch://bucket/run")
    assert not caught.value.transient
    tier = RemoteTier("s3://bucket/run", {"no_such_option": 1})  # s3fs complains on first use
    with pytest.raises(RemoteError, match="listing s3://bucket/run: permanent error TypeError") as caught:
        tier.steps()
    assert not caught.value.transient


@pytest.mark.parametrize("cloud_url", ["s3", "gcs", "azure"], indirect=True)
def test_the_stores_own_checksum_is_recorded_and_checked_without_a_download(cloud_url, tmp_path, monkeypatch):
    url, options = cloud_url
    tier = RemoteTier(url, options)
    states = [{"w": np.arange(300_000, dtype=np.float32)}]
    manifest = save_sharded(states, tmp_path / "local", step=4)
    record = manifest.shard(0)
    landed = tier.land_shard(4, record, ShardSource(path=tmp_path / "local" / record.path))
    assert landed.sent
    kept = landed.checksum
    assert kept.startswith("md5:" if url.startswith("az://") else "crc32c:")  # Azure keeps no CRC of a blob
    remote = tier.commit(manifest, landed=[landed])  # as the uploader hands it to the rank that commits
    assert tier.read_manifest(4).store_checksums == remote.store_checksums == {record.path: kept}
    monkeypatch.setattr(RemoteTier, "open_shard", lambda *args: pytest.fail("downloaded"))
    assert tier.check_store_checksum(4, record, kept) is None
    tier.backend.fs.pipe_file(
        f"{tier.backend.root}/step-000000000004/{record.path}", bytes(record.size_bytes)
    )  # same size
    assert "the store keeps checksum" in tier.check_store_checksum(4, record, kept)


def test_abort_orphans_aborts_only_this_librarys_unfinished_uploads_old_enough(s3_url, monkeypatch):
    import time

    url, options = s3_url
    tier = RemoteTier(url, options)
    bucket, prefix, _version = tier.backend.fs.split_path(tier.backend.root)
    for key in (f"{prefix}/step-000000000007/rank-00000-of-00001.safetensors", f"{prefix}/someone-elses/file"):
        tier.backend.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)

    def open_keys():
        uploads = tier.backend.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
        return sorted(upload["Key"][len(prefix) + 1 :] for upload in uploads)

    started = tier.backend.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)["Uploads"][0]["Initiated"]
    with monkeypatch.context() as clock:  # moto dates every upload 2010-11-10: the test's "now" is 10 s after it
        clock.setattr(time, "time", lambda: started.timestamp() + 10)
        assert tier.abort_orphans(older_than_seconds=3600) == []  # just started: may be a running upload
    assert len(open_keys()) == 2
    assert tier.abort_orphans() == [f"{url}/step-000000000007/rank-00000-of-00001.safetensors"]
    assert open_keys() == ["someone-elses/file"]  # not an object of ours: left alone


def eleven_mib_shard(tmp_path):
    states = [{"w": np.random.default_rng(0).integers(0, 255, 11 << 20, dtype=np.uint8)}]
    manifest = save_sharded(states, tmp_path / "local", step=4)
    return tmp_path / "local" / manifest.shard(0).path, manifest.shard(0)


def test_a_multipart_upload_is_confirmed_against_the_crc32c_the_store_composed(s3_url, tmp_path):
    """11 MiB in 5 MiB parts: moto composes the object's CRC32C from the parts it received,
    which the confirmation recomputes from the file (S3 checks each part on receipt)."""
    url, options = s3_url
    tier = RemoteTier(url, options, part_bytes=5 << 20)
    path, record = eleven_mib_shard(tmp_path)
    landed = tier.land_shard(4, record, ShardSource(path=path))
    assert landed.sent
    bucket, key, _version = tier.backend.fs.split_path(f"{tier.backend.root}/step-000000000004/{record.path}")
    head = tier.backend.fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    assert head["ETag"].endswith('-3"')  # really a multipart upload, of 3 parts
    kept = landed.checksum
    assert kept.endswith("-3") and kept.removesuffix("-3") == "crc32c:" + head["ChecksumCRC32C"]  # moto's HEAD: no -N
    assert not tier.land_shard(4, record, ShardSource(path=path)).sent  # confirmed intact: not sent again


@pytest.mark.slow
def test_a_part_changed_in_transit_is_never_confirmed(moto_endpoint, s3_url, tmp_path):
    from support.stores import FaultInjectingProxy, s3_storage_options

    url, _options = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=0.0, corrupt=("PUT",))  # parts are PUTs
    try:
        tier = RemoteTier(url, s3_storage_options(proxy.endpoint), retry=RetryPolicy(max_tries=1), part_bytes=5 << 20)
        path, record = eleven_mib_shard(tmp_path)
        with pytest.raises(RemoteError, match="not confirmed after the upload: the store computed ChecksumCRC32C"):
            tier.land_shard(4, record, ShardSource(path=path))
    finally:
        proxy.close()


def test_a_shard_damaged_on_local_disk_is_never_uploaded_in_parts(s3_url, tmp_path):
    url, options = s3_url
    tier = RemoteTier(url, options, part_bytes=5 << 20)
    path, record = eleven_mib_shard(tmp_path)
    flip_byte(path, 7 << 20)
    with pytest.raises(ChecksumMismatchError, match="before its upload"):
        tier.land_shard(4, record, ShardSource(path=path))
    bucket, prefix, _version = tier.backend.fs.split_path(tier.backend.root)
    assert not tier.backend.fs.exists(f"{tier.backend.root}/step-000000000004/{record.path}")
    assert tier.backend.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", []) == []


# -- exact keys: glob characters in a URL name only themselves ------------------------------------


@pytest.mark.parametrize("name", ["sweep[12]", "sweep*", "sweep?"])
@pytest.mark.parametrize("remote_url", with_slow(REMOTES, "s3"), indirect=True)
def test_a_url_with_glob_characters_touches_only_its_own_steps(remote_url, saved, name, tmp_path):
    """Siblings ``sweep1`` and ``sweep2`` (which ``sweep[12]``, ``sweep*`` and ``sweep?`` match as
    patterns) keep every object while a run at the pattern's name lists, reads, prunes and
    deletes its own steps."""
    url, options = remote_url
    directory, manifest = saved
    base = url.rsplit("/", 1)[0]
    siblings = [RemoteTier(f"{base}/{sibling}", options) for sibling in ("sweep1", "sweep2")]
    for sibling in siblings:
        sibling.commit(manifest, landed=upload_all(sibling, directory, manifest))
    tier = RemoteTier(f"{base}/{name}", options)
    assert tier.list_steps() == ([], [])
    for step in (3, 4):
        step_manifest = dataclasses.replace(manifest, step=step)
        tier.commit(step_manifest, landed=upload_all(tier, directory, step_manifest))
    assert tier.list_steps() == ([3, 4], [])
    target = download(tier, 4, manifest.shard(1), tmp_path / "downloaded")
    assert target.read_bytes() == (directory / manifest.shard(1).path).read_bytes()
    store = TieredStore([LocalTier(tmp_path / "local-of-the-run"), tier], {"remote": RetentionPolicy(keep_last=1)})
    assert pruning.retain(store, tier) == [3]
    tier.delete_step(4)
    assert tier.list_steps() == ([], [])
    for sibling in siblings:
        assert sibling.list_steps() == ([3], [])
        assert all(sibling.check_shard(3, record) is None for record in manifest.shards)


# -- the bucket is checked when the tier is opened ---------------------------------------------


def test_a_missing_bucket_is_refused_at_manager_construction_naming_it(tmp_path, cloud_url):
    url, options = cloud_url
    scheme, bucket = url.split("://")[0], "tiered-no-such-bucket"
    with pytest.raises(RemoteError, match=f"the bucket '{bucket}' does not exist") as caught:
        CheckpointManager(
            tmp_path / "ckpt", world_size=1, remote=RemoteOptions(f"{scheme}://{bucket}/run", storage_options=options)
        )
    assert not caught.value.transient and caught.value.tries == 1  # permanent: one request, no retries
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    RemoteTier(url, options).check_bucket()  # a bucket that exists (and an empty prefix in it) is fine


def test_a_bucket_failing_at_construction_is_logged_and_set_up_once_it_answers(tmp_path, moto_endpoint, s3_url, caplog):
    import logging

    from support.stores import FaultInjectingProxy, s3_storage_options

    url, _ = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=1.0)  # every request answered 503
    upload = UploadOptions(max_tries=3, backoff_seconds=0.01, max_backoff_seconds=0.05)
    caplog.set_level(logging.WARNING, logger="tiered_ckpt")
    try:
        remote = RemoteOptions(url, storage_options=s3_storage_options(proxy.endpoint))
        with CheckpointManager(tmp_path / "ckpt", world_size=1, remote=remote, upload=upload) as manager:
            (started,) = [r.getMessage() for r in caplog.records if "did not answer at start-up" in r.getMessage()]
            assert f"check its bucket {url.rsplit('/', 1)[0]}" in started and "transient" in started
            with pytest.raises(RemoteError, match="restore: the bucket .* does not answer") as caught:
                manager.restore()  # an empty disk: nothing to restore without the bucket
            assert caught.value.transient
            manager.save(1, {"w": np.arange(8, dtype=np.float32)}, blocking=True)
            proxy.failure_rate = 0.0  # the bucket answers: set up in the background, then step 1 goes up
            manager.wait(uploaded=True)
            assert manager.remote_steps() == [1]
    finally:
        proxy.close()


def test_wait_uploaded_returns_while_the_bucket_cannot_be_set_up_once_each_step_is_past_its_deadline(
    tmp_path, moto_endpoint, s3_url
):
    import threading

    from support.stores import FaultInjectingProxy, s3_storage_options

    url, _ = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=1.0)  # down from the start: set up in the background
    upload = UploadOptions(max_tries=2, backoff_seconds=0.01, max_backoff_seconds=0.05, deadline_seconds=1)
    try:
        remote = RemoteOptions(url, storage_options=s3_storage_options(proxy.endpoint))
        with CheckpointManager(tmp_path / "ckpt", world_size=1, remote=remote, upload=upload) as manager:
            for step in (1, 2):
                manager.save(step, {"w": np.full(8, step, np.float32)}, blocking=True)
            raised: list[BaseException] = []

            def wait_uploaded() -> None:
                try:
                    manager.wait(uploaded=True)
                except BaseException as exc:
                    raised.append(exc)

            waiting = threading.Thread(target=wait_uploaded, daemon=True)
            waiting.start()
            waiting.join(timeout=60)  # a guard against a hang: the bucket stays down all along
            assert not waiting.is_alive(), "wait(uploaded=True) waited for the bucket's setup"
            (error,) = raised
            assert isinstance(error, UploadError) and error.transient and error.step == 2
            assert "steps 1, 2 missed their upload deadline" in str(error)
            assert manager.steps() == [1, 2]  # kept on local disk
            proxy.failure_rate = 0.0  # the bucket answers: its setup queues the local-only steps again
            manager.save(3, {"w": np.full(8, 3, np.float32)})
            manager.wait(uploaded=True)
            assert manager.remote_steps() == [1, 2, 3]
    finally:
        proxy.close()


def test_a_close_during_the_setups_backoff_starts_no_further_setup_try(tmp_path, moto_endpoint, s3_url, caplog):
    import logging
    import time

    from support.stores import FaultInjectingProxy, s3_storage_options

    url, _ = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=1.0)
    # a backoff so long that the setup's second try could only come from the close
    upload = UploadOptions(max_tries=1, backoff_seconds=1e6, max_backoff_seconds=1e6)
    caplog.set_level(logging.WARNING, logger="tiered_ckpt")
    try:
        remote = RemoteOptions(url, storage_options=s3_storage_options(proxy.endpoint))
        manager = CheckpointManager(tmp_path / "ckpt", world_size=1, remote=remote, upload=upload)
        give_up = time.monotonic() + 60  # a guard against a hang, not a timing
        while not any("could not be set up (try 1)" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < give_up, "the setup was never tried in the background"
            time.sleep(0.02)
        before = len(proxy.log)
        manager.close()
        assert [method for method, _path in proxy.log[before:]] in ([], ["POST"])  # the lease's release at most
        assert not any("could not be set up (try 2)" in r.getMessage() for r in caplog.records)
    finally:
        proxy.close()


# -- an object longer than its record is never read whole ---------------------------------------


@pytest.mark.parametrize("remote_url", with_slow(REMOTES, "s3"), indirect=True)
def test_an_object_32_mib_longer_than_its_record_is_refused_before_it_is_read(remote_url, saved, tmp_path):
    url, options = remote_url
    tier = RemoteTier(url, options)
    directory, manifest = saved
    tier.commit(manifest, landed=upload_all(tier, directory, manifest))
    record = manifest.shard(1)
    longer = (directory / record.path).read_bytes() + bytes(32 << 20)
    tier.backend.fs.pipe_file(f"{tier.backend.root}/step-000000000003/{record.path}", longer)
    read = []

    def count(source):
        while chunk := source.read(1 << 20):
            read.append(len(chunk))
        return record.verify(hash_stream(io.BytesIO(b"")), "never")  # not reached: too long

    with pytest.raises(ChecksumMismatchError, match=f"{record.size_bytes + 1} bytes|{len(longer)} bytes"):
        tier.open_shard(3, record, count)
    assert sum(read) <= record.size_bytes + 1  # at most one byte past the record, whatever the object holds
    root = tmp_path / "refill"
    with pytest.raises(ChecksumMismatchError, match=record.path):
        download(tier, 3, record, root)
    assert sum(path.stat().st_size for path in root.rglob("*") if path.is_file()) == 0  # nothing landed
    assert "bytes, the manifest records" in tier.check_shard(3, record)


def test_a_bucket_that_cannot_be_listed_is_refused_as_access_denied(tmp_path):
    """An S3 endpoint on loopback that answers every request 403 AccessDenied, as S3 does for
    credentials without s3:ListBucket: told apart from a missing bucket, and not retried."""
    import http.server
    import threading

    from support.stores import s3_storage_options

    class Denying(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _deny(self):
            body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            self.send_response(403)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _deny

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Denying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        options = s3_storage_options(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(RemoteError, match="access to the bucket 'locked' is denied") as caught:
            CheckpointManager(
                tmp_path / "ckpt", world_size=1, remote=RemoteOptions("s3://locked/run", storage_options=options)
            )
        assert not caught.value.transient and caught.value.tries == 1
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_a_restore_from_sixty_steps_goes_through_a_bucket_failing_a_tenth_of_its_requests(tmp_path, faulty_s3, s3_url):
    proxy, url, options = faulty_s3
    proxy.failure_rate = 0.0  # the steps go up directly, the restores through the faults
    direct = RemoteTier(*s3_url)
    for step in range(1, 61):
        manifest = save_sharded([{"w": np.full(16, step, np.float32)}], tmp_path / "saved" / f"{step}", step=step)
        direct.commit(manifest, landed=upload_all(direct, tmp_path / "saved" / f"{step}", manifest))
    proxy.failure_rate = 0.1
    upload = UploadOptions(backoff_seconds=0.001, max_backoff_seconds=0.01)  # the default max_tries
    remote = RemoteOptions(url, storage_options=options)
    with CheckpointManager(tmp_path / "node", world_size=1, remote=remote, upload=upload) as node:
        # 20 restores, each listing the bucket (a LIST and 60 manifest checks) and taking a step
        # this empty disk lacks from it: the newest, then 59 down to 41
        for step in [None, *range(59, 40, -1)]:
            result = node.restore(step)
            assert result.step == (step or 60) and result.sources == {0: "remote"}
            np.testing.assert_array_equal(result.states[0]["w"], np.full(16, result.step, np.float32))
    assert proxy.injected > 100  # a tenth of some 1,300 requests
