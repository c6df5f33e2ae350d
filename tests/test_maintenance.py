"""pull, push, prune and lag (tiered_ckpt/maintenance.py): one implementation for the manager and the CLI."""

from contextlib import closing

import numpy as np
import pytest

from tiered_ckpt import CheckpointManager, LocalOptions, RemoteOptions, UploadError, UsageError, maintenance
from tiered_ckpt.engine.replication import Replicator
from tiered_ckpt.format.layout import MANIFEST_NAME, RECEIPT_NAME, step_dir_name
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.backends.wrappers import Wrapper
from tiered_ckpt.tiers.remote.leases import OwnershipPolicy
from tiered_ckpt.tiers.remote.tier import RemoteTier
from tiered_ckpt.tiers.store import TieredStore


def test_the_orphan_age_and_the_lease_defaults_are_the_ownership_policys():
    remote, policy = RemoteOptions("s3://bucket/run"), OwnershipPolicy()
    assert remote.ownership == policy
    assert (remote.orphan_age_seconds, remote.lease_seconds) == (policy.orphan_age_seconds, policy.lease_seconds)


def test_a_maintenance_operation_needs_one_process_holding_every_rank():
    maintenance.check_one_process("prune", 4, 4)
    with pytest.raises(UsageError, match="prune is a maintenance operation of one process holding every rank"):
        maintenance.check_one_process("prune", 1, 4)


def test_the_managers_maintenance_waits_for_its_writes_then_runs_on_its_store(tmp_path):
    with CheckpointManager(tmp_path, world_size=2) as manager:
        manager.save(1, [{"w": np.zeros(4, np.float32)}] * 2)  # not waited for: the prune waits
        with pytest.raises(UsageError, match="push needs a remote tier"):
            manager.push()
        pruned = manager.prune(dry_run=True)
        assert pruned.deleted == {"local": ()} and pruned.dry_run
        assert pruned.aborted == () and pruned.kept_unproven == ()
        assert manager.steps() == [1]


def test_push_mends_a_lost_receipt_of_a_step_the_bucket_committed_and_sends_nothing(tmp_path, memory_url):
    """A crash between the bucket's commit and the receipt's write: push records the commit
    instead of sending the step again (whose objects another zstd would rewrite otherwise)."""
    url, options = memory_url
    remote = RemoteOptions(url, storage_options=options, compression="zstd")
    with CheckpointManager(tmp_path, world_size=2, remote=remote) as manager:
        manager.save(1, [{"w": np.arange(1000, dtype=np.float32) + rank} for rank in range(2)], blocking=True)
        manager.wait(uploaded=True)
    (tmp_path / step_dir_name(1) / RECEIPT_NAME).unlink()
    puts = []

    class Puts(Wrapper):
        def put_shard(self, local_path, path, record, *, deadline):
            puts.append(path)
            return super().put_shard(local_path, path, record, deadline=deadline)

    bucket = RemoteTier(url, options, compression="zstd", wrap=Puts)
    store = TieredStore([LocalTier(tmp_path), bucket])
    assert not store.receipted(1)
    with store.local.lock(), closing(Replicator(store, bucket)) as uploader:
        pushed = maintenance.push(store, uploader)
        uploader.errors.raise_first()
    assert pushed.steps == () and puts == [] and store.receipted(1)


def test_push_carries_on_past_a_step_whose_commit_it_cannot_read(tmp_path, memory_url):
    """Step 1's receipt lost and the bucket's manifest of it damaged, step 2 never sent: step 2
    goes up, and step 1's problem waits in the uploader's error box with its step."""
    url, options = memory_url
    with CheckpointManager(
        LocalOptions(tmp_path, keep_last=None), world_size=1, remote=RemoteOptions(url, storage_options=options)
    ) as manager:
        manager.save(1, [{"w": np.arange(1000, dtype=np.float32)}], blocking=True)
        manager.wait(uploaded=True)
    with CheckpointManager(LocalOptions(tmp_path, keep_last=None), world_size=1) as manager:  # no bucket
        manager.save(2, [{"w": np.arange(1000, dtype=np.float32) + 2}], blocking=True)
    (tmp_path / step_dir_name(1) / RECEIPT_NAME).unlink()
    bucket = RemoteTier(url, options)
    bucket.backend.put_bytes(bucket._path(1, MANIFEST_NAME), b"{not json")
    store = TieredStore([LocalTier(tmp_path), bucket])
    with store.local.lock(), closing(Replicator(store, bucket)) as uploader:
        assert maintenance.push(store, uploader, 2).steps == (2,)  # step 1's record is not even read
        assert store.receipted(2) and not store.receipted(1)
        maintenance.push(store, uploader)  # step 1 queued all the same: its upload says what is wrong
        with pytest.raises(UploadError, match="step 1"):
            uploader.errors.raise_first()
    assert bucket.steps() == [1, 2]
