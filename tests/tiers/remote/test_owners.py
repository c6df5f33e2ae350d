"""Run identities on the bucket (tiered_ckpt.tiers.remote.leases) and what they protect: a live run's
half-uploaded step and open multipart upload survive a second manager on the same URL;
what a dead run left is removed; a commit over an object gone since its confirmation is
never written. Times come from a clock the test sets, never from waiting."""

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tiered_ckpt import (
    CheckpointManager,
    RemoteError,
    RemoteInUseError,
    RemoteOptions,
    UploadError,
    UploadOptions,
    save_sharded,
)
from tiered_ckpt.build import replication_policy
from tiered_ckpt.engine.background import ErrorBox
from tiered_ckpt.engine.replication import Replicator
from tiered_ckpt.errors import ConfigError
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.maintenance import push
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.leases import Lease, OwnerRecord, OwnershipPolicy, live_owners
from tiered_ckpt.tiers.remote.tier import RemoteTier, RetryPolicy
from tiered_ckpt.tiers.store import TieredStore

HERE = Path(__file__).resolve().parents[2]


class Clock:
    """Unix times the test moves by hand."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def foreign_record(run_id: str, renewed_at: float, ttl: float = 300.0) -> bytes:
    """An owner record of a run on another machine (its process cannot be looked up here)."""
    record = OwnerRecord(run_id, "node-7", 4242, "", "", renewed_at - 60, renewed_at, ttl)
    return record.to_json().encode()


def start_up(store, clock, ownership=None):
    """An uploader's start-up (lease, clean-up, listing) and close, on ``clock``."""
    uploader = Replicator(store, errors=ErrorBox(), ownership=ownership, clock=clock)
    try:
        uploader.resume()
    finally:
        uploader.close()


def open_uploads(tier):
    bucket, prefix, _version = tier.backend.fs.split_path(tier.backend.root)
    uploads = tier.backend.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/").get("Uploads", [])
    return sorted(upload["Key"][len(prefix) + 1 :] for upload in uploads)


def object_exists(tier, step, name):
    return tier.backend.exists(f"{tier.backend.root}/{step_dir_name(step)}/{name}")


# -- the lease itself ---------------------------------------------------------------------


def test_a_lease_is_written_renewed_and_removed_as_strict_json(memory_url):
    url, options = memory_url
    tier, clock = RemoteTier(url, options), Clock()
    lease = Lease(tier, OwnershipPolicy(lease_seconds=60), clock=clock)
    assert lease.hold() == []
    record = OwnerRecord.from_json(tier.read_owners()[lease.run_id], "test")
    assert (record.renewed_at, record.ttl_seconds) == (clock.now, 60.0)
    clock.now += 30
    lease.renew()
    assert OwnerRecord.from_json(tier.read_owners()[lease.run_id], "test").renewed_at == clock.now
    lease.release()
    assert tier.read_owners() == {}
    lease.renew()  # after release: nothing is written again
    assert tier.read_owners() == {}


def test_a_lease_not_renewed_within_its_ttl_is_dead(memory_url):
    url, options = memory_url
    tier, clock = RemoteTier(url, options), Clock()
    tier.write_owner("ab" * 8, foreign_record("ab" * 8, renewed_at=clock.now, ttl=300))
    assert [owner.run_id for owner in live_owners(tier, clock.now + 300)] == ["ab" * 8]
    assert live_owners(tier, clock.now + 301) == []


def test_a_record_of_a_process_of_this_machine_that_is_gone_is_dead_at_once(memory_url):
    url, options = memory_url
    tier, clock = RemoteTier(url, options), Clock()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    lease = Lease(tier, clock=clock)
    lease.hold()
    mine = OwnerRecord.from_json(tier.read_owners()[lease.run_id], "test")
    assert mine.live(clock.now)  # this process runs
    gone = OwnerRecord(**{**mine.__dict__, "run_id": "cd" * 8, "pid": child.pid})
    assert not gone.live(clock.now)
    lease.release()


def test_a_record_that_does_not_parse_counts_as_live_and_is_named(memory_url, caplog):
    url, options = memory_url
    tier = RemoteTier(url, options)
    tier.write_owner("ef" * 8, b'{"kind": "tiered_ckpt.owner/1", "pid": "not a number"}')
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        assert [owner.run_id for owner in live_owners(tier, 1e12)] == ["ef" * 8]
    assert any(f"owners/{'ef' * 8}.json" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    "field, value", [("lease_seconds", 0), ("lease_seconds", float("nan")), ("orphan_age_seconds", -1)]
)
def test_ownership_options_are_checked(field, value):
    with pytest.raises(ConfigError, match=field):
        RemoteOptions("memory://bucket/run", **{field: value})
    with pytest.raises(ConfigError, match="other_owners"):
        RemoteOptions("memory://bucket/run", other_owners="ignore")


# -- what the leases protect ---------------------------------------------------------------


@pytest.mark.slow
def test_a_second_manager_leaves_a_live_jobs_upload_and_multipart_upload_intact(tmp_path, s3_url, caplog):
    """Job A (a real process) is mid-upload: rank 0's object confirmed, rank 1's multipart
    upload open. A second manager on the same URL deletes and aborts nothing of it; once A
    is killed, the next start removes what it left."""
    url, options = s3_url
    remote = json.dumps({"url": url, "options": options})
    child = subprocess.Popen(
        [sys.executable, str(HERE / "support" / "lease_child.py"), str(tmp_path / "a"), remote],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "PAUSED"  # waits for the child, whatever it takes
        tier = RemoteTier(url, options)
        assert object_exists(tier, 1, "rank-00000-of-00002.safetensors")
        assert open_uploads(tier) == ["step-000000000001/rank-00001-of-00002.safetensors"]
        (run_a,) = tier.read_owners()
        with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
            with CheckpointManager(
                tmp_path / "b", world_size=2, remote=RemoteOptions(url, storage_options=options)
            ) as b:
                b.save(5, [{"w": np.zeros(4, np.float32)}] * 2)
                b.wait(uploaded=True)
        assert object_exists(tier, 1, "rank-00000-of-00002.safetensors")  # A's confirmed object
        assert open_uploads(tier) == ["step-000000000001/rank-00001-of-00002.safetensors"]  # A's open upload
        assert tier.list_steps() == ([5], [1])
        warned = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
        assert any(run_a in message and "another live run" in message for message in warned)
    finally:
        child.kill()
        child.wait()
    with CheckpointManager(tmp_path / "c", world_size=2, remote=RemoteOptions(url, storage_options=options)):
        pass  # A is gone (killed, on this machine): its lease is dead, what it left is abandoned
    assert open_uploads(tier) == []
    assert tier.list_steps() == ([5], []) and tier.read_owners() == {}  # A's dead lease went too


def test_leftovers_stay_while_a_lease_lives_and_go_once_it_expired(tmp_path, s3_url):
    """The uploader's start-up clean-up on the test's clock: a run on another machine holds a
    lease; its half-uploaded step and open multipart upload stay until its lease has gone
    ``lease_seconds`` unrenewed, then go."""
    url, options = s3_url
    tier, clock = RemoteTier(url, options), Clock()
    bucket, prefix, _version = tier.backend.fs.split_path(tier.backend.root)
    key = f"{prefix}/{step_dir_name(7)}/rank-00001-of-00002.safetensors"
    tier.backend.fs.pipe_file(f"{tier.backend.root}/{step_dir_name(7)}/rank-00000-of-00002.safetensors", b"confirmed")
    tier.backend.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    tier.write_owner("ab" * 8, foreign_record("ab" * 8, renewed_at=clock.now, ttl=300))
    store = TieredStore([LocalTier(tmp_path / "ckpt"), tier])
    with store.local.lock():
        clock.now += 299  # renewed 299 s ago: live
        start_up(store, clock, OwnershipPolicy(orphan_age_seconds=0))
        assert tier.uncommitted_steps() == [7] and open_uploads(tier) == [key[len(prefix) + 1 :]]
        clock.now += 2  # 301 s: dead
        start_up(store, clock, OwnershipPolicy(orphan_age_seconds=0))
        assert tier.uncommitted_steps() == [] and open_uploads(tier) == []
    assert tier.read_owners() == {}  # the dead run's record went with what it left


@pytest.mark.slow
def test_multipart_uploads_are_aborted_only_past_the_orphan_age(tmp_path, s3_url):
    url, options = s3_url
    tier = RemoteTier(url, options)
    bucket, prefix, _version = tier.backend.fs.split_path(tier.backend.root)
    tier.backend.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=f"{prefix}/{step_dir_name(3)}/x.safetensors")
    (started,) = tier.backend.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/")["Uploads"]
    clock = Clock(started["Initiated"].timestamp() + 3599)
    store = TieredStore([LocalTier(tmp_path / "ckpt"), tier])
    with store.local.lock():
        for expected in ([f"{step_dir_name(3)}/x.safetensors"], []):
            start_up(store, clock)  # the default orphan age: one hour
            assert open_uploads(tier) == expected
            clock.now += 2


def test_other_owners_refuse_raises_naming_the_other_run_and_leaves_no_record(tmp_path, memory_url):
    url, options = memory_url
    tier = RemoteTier(url, options)
    tier.write_owner("ab" * 8, foreign_record("ab" * 8, renewed_at=1e12))  # renewed "in the future": live
    remote = RemoteOptions(url, storage_options=options, other_owners="refuse")
    with pytest.raises(RemoteInUseError, match=f"run {'ab' * 8} \\(host node-7, pid 4242"):
        CheckpointManager(tmp_path / "ckpt", world_size=1, remote=remote)
    assert tier.read_owners().keys() == {"ab" * 8}


def test_remote_retention_deletes_nothing_while_another_run_is_live(tmp_path, memory_url):
    url, options = memory_url
    tier = RemoteTier(url, options)
    tier.write_owner("ab" * 8, foreign_record("ab" * 8, renewed_at=1e12))
    with CheckpointManager(tmp_path / "ckpt", world_size=1, remote=RemoteOptions(url, keep_last=1)) as manager:
        for step in (1, 2, 3):
            manager.save(step, [{"w": np.full(4, step, np.float32)}])
            manager.wait(uploaded=True)
        assert manager.remote_steps() == [1, 2, 3]
    tier.delete_owner("ab" * 8)
    with CheckpointManager(tmp_path / "ckpt", world_size=1, remote=RemoteOptions(url, keep_last=1)) as manager:
        manager.save(4, [{"w": np.full(4, 4, np.float32)}])
        manager.wait(uploaded=True)
        assert manager.remote_steps() == [4]


def test_a_bucket_that_keeps_every_step_looks_for_no_other_run_after_a_commit(
    tmp_path, memory_url, caplog, monkeypatch
):
    from tiered_ckpt.engine import sending

    looked = []
    monkeypatch.setattr(sending, "other_runs", lambda lease: looked.append(lease) or ["ab" * 8])
    url, options = memory_url
    for keep_last, looks in ((None, 0), (1, 2)):  # keep_last=None: the default, deletes nothing
        caplog.clear()
        looked.clear()
        remote = RemoteOptions(f"{url}/keep-{keep_last}", keep_last=keep_last)
        with CheckpointManager(tmp_path / f"ckpt-{keep_last}", world_size=1, remote=remote) as manager:
            with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
                for step in (1, 2):
                    manager.save(step, [{"w": np.full(4, step, np.float32)}])
                    manager.wait(uploaded=True)
        assert len(looked) == looks
        skipped = [record for record in caplog.records if "retention of" in record.getMessage()]
        assert len(skipped) == looks  # warned each time it looked and found another run


# -- the commit confirms every object once more -------------------------------------------


def test_an_object_gone_between_its_confirmation_and_the_commit_means_no_commit(tmp_path, remote_url, monkeypatch):
    url, options = remote_url
    save_sharded(
        [{"w": np.full(64, rank, np.float32)} for rank in range(2)], tmp_path / "ckpt" / step_dir_name(1), step=1
    )
    tier = RemoteTier(url, options, retry=RetryPolicy(max_tries=2, backoff_seconds=0))
    store = TieredStore([LocalTier(tmp_path / "ckpt"), tier])
    original = RemoteTier.land_shard

    def put_then_lose_rank_0(self, step, record, source, **kwargs):
        put = original(self, step, record, source, **kwargs)
        if record.rank == 1:  # both confirmed; then someone deletes rank 0's object
            self.backend.fs.rm_file(f"{self.backend.root}/{step_dir_name(step)}/rank-00000-of-00002.safetensors")
        return put

    monkeypatch.setattr(RemoteTier, "land_shard", put_then_lose_rank_0)
    with store.local.lock():
        one_at_a_time = replication_policy(UploadOptions(concurrency=1))  # rank 0, then 1
        uploader = Replicator(store, policy=one_at_a_time, errors=ErrorBox())
        try:
            with pytest.raises(UploadError, match="rank-00000-of-00002.safetensors: missing") as caught:
                push(store, uploader, 1)  # the failure waits in the uploader's box
                uploader.errors.raise_first()
        finally:
            uploader.close()
    assert isinstance(caught.value.__cause__, RemoteError) and not caught.value.__cause__.transient
    assert tier.steps() == [] and not store.receipted(1)


def test_read_owners_besides_a_run_leaves_its_record_unread(memory_url):
    from tiered_ckpt.tiers.remote.backends.wrappers import Wrapper

    read = []

    class Reads(Wrapper):
        def read(self, path, start=None, end=None):
            read.append(path)
            return super().read(path, start, end)

    url, options = memory_url
    tier = RemoteTier(url, options, wrap=Reads)
    for run_id in ("aa" * 8, "bb" * 8, "cc" * 8):
        tier.write_owner(run_id, foreign_record(run_id, renewed_at=1e12))
    assert tier.read_owners(besides="bb" * 8).keys() == {"aa" * 8, "cc" * 8}
    assert len(read) == 2 and not any("bb" * 8 in path for path in read)
    assert tier.read_owners().keys() == {"aa" * 8, "bb" * 8, "cc" * 8}


def test_read_owners_reads_the_records_at_once_and_a_failed_read_raises_after_the_others(memory_url):
    from tiered_ckpt.tiers.remote.backends.wrappers import Wrapper

    both = threading.Barrier(2, timeout=30)  # records read one after another never meet here
    read = []

    class Meets(Wrapper):
        def read(self, path, start=None, end=None):
            both.wait()
            data = super().read(path, start, end)
            read.append(path)
            if "aa" * 8 in path:
                raise PermissionError(f"{path}: access denied")
            return data

    url, options = memory_url
    tier = RemoteTier(url, options, wrap=Meets, retry=RetryPolicy(max_tries=1))
    for run_id in ("aa" * 8, "bb" * 8, "cc" * 8):
        tier.write_owner(run_id, foreign_record(run_id, renewed_at=1e12))
    with pytest.raises(RemoteError, match="reading the owner records") as caught:
        tier.read_owners(besides="cc" * 8)
    assert isinstance(caught.value.__cause__, PermissionError) and not caught.value.transient
    assert len(read) == 2  # the other record was read through before the error came out
