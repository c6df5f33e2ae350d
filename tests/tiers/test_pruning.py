"""Each tier's retention as data, applied by the store's pruning: what goes, and what stays for a later tier."""

import threading

import numpy as np
import pytest

from support.memory_tier import MemoryTier
from tiered_ckpt import maintenance, save_sharded
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.tiers import pruning, step_records
from tiered_ckpt.tiers.base import ShardSource
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.tier import RemoteTier
from tiered_ckpt.tiers.retention import RetentionPolicy
from tiered_ckpt.tiers.store import TieredStore


def put(tier, store, manifest):
    landed = [
        tier.land_shard(manifest.step, record, ShardSource(path=store.local.shard_path(manifest.step, record)))
        for record in manifest.shards
    ]
    return tier.commit(manifest, landed=landed)


@pytest.fixture
def store(tmp_path, memory_url):
    """Steps 1..4 on the local disk and in a partner's memory; the bucket committed ``uploaded`` (with receipts)."""
    peer, bucket = MemoryTier("peer"), RemoteTier(*memory_url)
    store = TieredStore([LocalTier(tmp_path / "ckpt"), peer, bucket])
    manifests = {}
    for step in range(1, 5):
        states = [{"w": np.full(16, step, np.float32)}]
        manifests[step] = save_sharded(states, tmp_path / "ckpt" / step_dir_name(step), step=step)
        put(peer, store, manifests[step])

    def upload(*steps):
        for step in steps:
            store.record_commit(step, bucket, put(bucket, store, manifests[step]))

    with store.local.lock():
        yield store, peer, bucket, upload


def test_each_tier_keeps_what_its_own_policy_says(store):
    store, peer, bucket, upload = store
    upload(1, 2, 3, 4)
    store.retention = {"local": RetentionPolicy(keep_last=1), "peer": RetentionPolicy(keep_last=2)}
    planned = maintenance.prune(store, dry_run=True)
    assert planned == maintenance.PruneResult(
        {"local": (1, 2, 3), "peer": (1, 2), "remote": ()}, aborted=(), kept_unproven=(), dry_run=True
    )
    assert list(planned.deleted) == ["local", "peer", "remote"]  # in the store's order
    assert store.local.steps() == [1, 2, 3, 4]  # a dry run deletes nothing
    plan = maintenance.prune(store)
    assert dict(plan.deleted) == {"local": (1, 2, 3), "peer": (1, 2), "remote": ()} and not plan.dry_run
    assert (plan.aborted, plan.kept_unproven) == ((), ())
    assert (store.local.steps(), peer.steps(), bucket.steps()) == ([4], [3, 4], [1, 2, 3, 4])


def test_the_disk_keeps_what_the_bucket_has_not_committed_but_not_what_a_memory_lacks(store):
    store, peer, _bucket, upload = store
    upload(1, 3)  # step 2 never reached the bucket; step 4 is newer than its newest commit
    store.retention = {"local": RetentionPolicy(keep_last=1)}
    assert pruning.to_delete(store, store.local, {"remote": [2]}) == [1, 3]  # step 2 is queued: kept
    assert pruning.to_delete(store, store.local) == [1, 2, 3]  # superseded in the bucket by step 3
    peer.delete_step(4)
    assert pruning.to_delete(store, store.local) == [1, 2, 3]  # a memory's copy protects nothing
    assert pruning.retain(store, store.local, {"remote": [2]}) == [1, 3] and store.local.steps() == [2, 4]


def test_without_a_bucket_commit_every_newer_local_step_waits(store):
    store, _peer, _bucket, upload = store
    store.retention = {"local": RetentionPolicy(keep_last=1, max_awaiting_upload=2)}
    assert pruning.to_delete(store, store.local) == [1, 2]  # the newest two waiting steps are kept
    upload(4)
    assert pruning.to_delete(store, store.local) == [1, 2, 3]


def test_only_the_steps_of_the_buckets_cadence_wait_for_it(store):
    store, _peer, _bucket, upload = store
    store.retention = {"local": RetentionPolicy(keep_last=1, max_awaiting_upload=8, upload_every=2)}
    assert pruning.to_delete(store, store.local) == [1, 3]  # 2 and 4 wait for the bucket; 1 and 3 never will
    assert pruning.to_delete(store, store.local, {"remote": [3]}) == [1]  # a step queued anyway (a preemption's)
    upload(4)
    assert pruning.to_delete(store, store.local) == [1, 2, 3]


def test_a_preemptions_stop_step_off_the_buckets_cadence_waits_for_it_after_a_restart_too(store):
    store, _peer, _bucket, upload = store
    store.retention = {"local": RetentionPolicy(keep_last=1, max_awaiting_upload=8, upload_every=2)}
    step_records.write_every_tier(store.local.step_dir(3), 3)  # what the stop step's commit records
    assert store.local.for_every_tier(3) and not store.local.for_every_tier(1)
    assert pruning.to_delete(store, store.local) == [1]  # no queue names step 3 (a new process): still kept
    upload(4)
    assert pruning.to_delete(store, store.local) == [1, 2, 3]  # superseded in the bucket


def test_every_queue_is_kept_and_a_steps_queue_for_a_memory_too(store):
    store, _peer, _bucket, upload = store
    upload(1)
    store.retention = {"local": RetentionPolicy(keep_last=1, max_awaiting_upload=1)}
    # the bucket has step 2 active and step 3 queued; a pass that saw only the peer's queue would delete them
    assert pruning.to_delete(store, store.local, {"remote": [2, 3], "peer": []}) == [1]
    assert pruning.to_delete(store, store.local, {"peer": [2]}) == [1, 3]  # queued for the partner: kept
    assert pruning.to_delete(store, store.local, {}) == [1, 2, 3]  # beyond max_awaiting_upload=1, unqueued


def test_a_buckets_slow_delete_holds_up_no_pass_of_the_local_tier(store):
    store, _peer, bucket, upload = store
    upload(1, 2, 3, 4)
    store.retention = {"local": RetentionPolicy(keep_last=1), "remote": RetentionPolicy(keep_last=1)}
    held, release = threading.Event(), threading.Event()
    delete = bucket.delete_step

    def slow_delete(step):  # a bucket whose delete is being retried
        held.set()
        release.wait()
        delete(step)

    bucket.delete_step = slow_delete
    remote = threading.Thread(target=pruning.retain, args=(store, bucket))
    remote.start()
    try:
        held.wait()
        assert pruning.retain(store, store.local) == [1, 2, 3]  # would block here if it waited for the bucket
    finally:
        release.set()
        remote.join()
    assert bucket.steps() == [4]


def test_every_holders_steps_are_kept_until_that_holder_releases_them(store):
    store, peer, bucket, upload = store
    upload(1, 2, 3, 4)
    store.retention = {"local": RetentionPolicy(keep_last=1)}
    first, second = object(), object()  # two plugins on one manager
    store.hold({1}, holder=first)
    store.hold({2}, holder=second)
    assert store.held == {1, 2} and pruning.to_delete(store, store.local) == [3]
    store.hold(set(), holder=first)  # the first releases its step; the second's stays held
    assert store.held == {2} and pruning.to_delete(store, store.local) == [1, 3]
