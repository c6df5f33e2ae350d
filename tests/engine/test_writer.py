"""The background writer (tiered_ckpt.engine.writer) on its own: a Writer over a LocalTier-backed
store with a SingleProcessCoordinator, no manager. A save lands every shard and commits; a failure
reaches the ErrorBox and is raised once; retention runs after the commit; the threads' CPUs and priority."""

import hashlib
import json
import os
import threading

import numpy as np
import pytest

from support.memory_tier import MemoryTier
from tiered_ckpt.dist.coordination import SingleProcessCoordinator
from tiered_ckpt.dist.sharding import resolve_sharded_keys, sharding_summary
from tiered_ckpt.engine.background import ErrorBox
from tiered_ckpt.engine.replication import Replicator
from tiered_ckpt.engine.save_handle import SaveHandle
from tiered_ckpt.engine.saving import SavePlan
from tiered_ckpt.engine.writer import BACKGROUND_NICENESS, Writer
from tiered_ckpt.errors import SaveError, ShardCountMismatchError, UsageError
from tiered_ckpt.format.layout import MANIFEST_NAME, step_dir_name
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.state import flatten
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.tier import RemoteTier
from tiered_ckpt.tiers.retention import RetentionPolicy
from tiered_ckpt.tiers.store import TieredStore


def rank_states(world_size, step=0, n=1000):
    rng = np.random.default_rng(step)
    return [
        {"param": rng.standard_normal(n).astype(np.float32), "bias": np.full((1, 3), rank + step, dtype=np.int64)}
        for rank in range(world_size)
    ]


class Harness:
    """A store locked on ``root`` and a writer saving ``world_size`` ranks from this process."""

    def __init__(self, root, world_size=2, retention=None, processes_ranks=None, cpus=None, budget=None):
        self.store = TieredStore([LocalTier(root)], {"local": retention or RetentionPolicy()})
        self.errors = ErrorBox()
        self._lock = self.store.local.lock()
        self._lock.__enter__()
        coordinator = SingleProcessCoordinator(processes_ranks or world_size)
        self.writer = Writer(
            self.store,
            coordinator,
            world_size=world_size,
            errors=self.errors,
            cpus=cpus,
            host_memory_bytes=budget,
        )

    def save(self, step, states):
        flat = [flatten(state, f"rank {rank}") for rank, state in enumerate(states)]
        keys, numels = resolve_sharded_keys([sharding_summary(s.arrays) for s in flat], None, flat=True)
        return self.writer.submit(step, SavePlan(tuple(flat), keys, tuple(numels)))

    def close(self):
        self.writer.close()
        self._lock.__exit__(None, None, None)


@pytest.fixture
def harness(tmp_path):
    made = []

    def make(**kwargs):
        made.append(Harness(tmp_path / "ckpt", **kwargs))
        return made[-1]

    yield make
    for each in made:
        each.close()


def read_back(store, step):
    manifest = store.local.manifest(step)
    return [store.local.read_shard(step, record).arrays for record in manifest.shards]


def assert_same(expected, got):
    assert len(expected) == len(got)
    for want, have in zip(expected, got, strict=True):
        assert sorted(want) == sorted(have)
        for key in want:
            np.testing.assert_array_equal(want[key], have[key])


# -- a save ------------------------------------------------------------------------------------


def test_a_save_lands_every_ranks_shard_and_commits_the_manifest(harness):
    h = harness(world_size=3)
    states = rank_states(3, step=5)
    handle = h.save(5, states)
    manifest = handle.committed.result()
    assert handle.step == 5 and handle.uploaded is None  # no replicator: no upload
    assert isinstance(manifest, ShardManifest) and manifest.step == 5 and manifest.world_size == 3
    assert h.store.local.steps() == [5] and h.store.local.uncommitted_steps() == []
    directory = h.store.local.step_dir(5)
    assert directory.name == step_dir_name(5)
    for rank, record in enumerate(manifest.shards):
        data = (directory / record.path).read_bytes()
        assert record.rank == rank and record.size_bytes == len(data)
        assert record.sha256 == hashlib.sha256(data).hexdigest()  # the record is of the bytes on disk
    on_disk = ShardManifest.from_dict(json.loads((directory / MANIFEST_NAME).read_text()), source="test")
    assert on_disk == manifest == handle.committed.result()
    assert_same(states, read_back(h.store, 5))
    assert h.store.local.held_ranks(5, manifest) == [0, 1, 2]


def test_the_handle_says_when_the_save_is_done():
    from concurrent.futures import Future

    committed, uploaded = Future(), Future()
    handle = SaveHandle(9, committed, uploaded)
    assert handle.step == 9 and handle.committed is committed and handle.uploaded is uploaded
    assert not handle.committed.done() and repr(handle) == "SaveHandle(step=9, committed=pending, uploaded=pending)"
    committed.set_exception(SaveError("failed", step=9))
    assert handle.committed.done() and repr(handle) == "SaveHandle(step=9, committed=failed, uploaded=pending)"
    assert isinstance(handle.committed.exception(), SaveError)  # waiting raises nothing: the error box has it
    uploaded.set_result(None)
    assert repr(handle) == "SaveHandle(step=9, committed=failed, uploaded=done)"
    done = Future()
    done.set_result("manifest")
    assert repr(SaveHandle(3, done, None)) == "SaveHandle(step=3, committed=done, uploaded=none)"


def test_the_caller_may_overwrite_its_arrays_once_submit_returns(harness):
    h = harness(world_size=2)
    states = rank_states(2, step=1, n=200_000)
    expected = [{key: array.copy() for key, array in state.items()} for state in states]
    handle = h.save(1, states)
    for state in states:
        for array in state.values():
            array.fill(-1)
    handle.committed.result()
    assert_same(expected, read_back(h.store, 1))


def test_the_room_a_restore_has_beside_the_staging_is_what_the_saves_buffers_leave(harness):
    h = harness(world_size=2, budget=3 << 20)
    assert h.writer.restore_room() == 3 << 20
    h.save(1, rank_states(2, step=1, n=200_000)).committed.result()  # 2 x 800 KB, kept for the next save
    assert h.writer.restore_room() == (3 << 20) - 2 * (200_000 * 4 + 3 * 8)
    h.save(2, rank_states(2, step=2, n=2_000_000)).committed.result()  # past the budget: staging holds all of it
    assert h.writer.restore_room() == 0
    assert h.writer.restore_room(release=True) == 3 << 20  # let go: the next save allocates them again
    states = rank_states(2, step=3, n=200_000)
    h.save(3, states).committed.result()
    assert_same(states, read_back(h.store, 3))
    h.close()
    assert harness(world_size=1).writer.restore_room() is None  # no budget, no bound


def test_close_finishes_the_queued_write(tmp_path):
    h = Harness(tmp_path / "ckpt", world_size=2)
    h.save(3, rank_states(2))
    h.close()  # no wait before it
    assert LocalTier(tmp_path / "ckpt").steps() == [3]


def test_saves_submitted_back_to_back_each_keep_their_own_arrays(harness):
    # the staging buffers are reused from save to save: a submit must not refill them under
    # the previous save's running write (the manager waits before it; the writer itself must too)
    h = harness(world_size=2)
    handles = [h.save(step, rank_states(2, step, n=500_000)) for step in (1, 2, 3)]
    assert [handle.committed.result().step for handle in handles] == [1, 2, 3]
    assert h.store.local.steps() == [1, 2, 3]
    for step in (1, 2, 3):
        assert_same(rank_states(2, step, n=500_000), read_back(h.store, step))


# -- failures -------------------------------------------------------------------------------------


def test_a_failed_write_is_a_save_error_in_the_box_raised_once_by_the_next_call(harness):
    h = harness(world_size=2)
    h.save(1, rank_states(2)).committed.result()
    blocker = h.store.local.step_dir(2)
    blocker.write_text("not a directory")  # the step's directory cannot be made
    handle = h.save(2, rank_states(2))
    h.writer.settle()
    assert handle.committed.done() and isinstance(handle.committed.exception(), SaveError)  # no manifest
    with pytest.raises(SaveError, match=f"background save of step 2 to {blocker} failed") as caught:
        h.errors.raise_first()
    assert caught.value.step == 2 and isinstance(caught.value.__cause__, FileExistsError)
    h.errors.raise_first()  # raised once: the box is empty now
    assert h.store.local.steps() == [1] and blocker.read_text() == "not a directory"  # nothing else touched
    blocker.unlink()
    h.save(3, rank_states(2, 3)).committed.result()  # the writer still works
    assert h.store.local.steps() == [1, 3]


def test_a_failure_raised_by_the_handle_is_not_raised_again_by_the_box(harness):
    h = harness(world_size=1)
    h.store.local.step_dir(4).mkdir(parents=True)
    (h.store.local.step_dir(4) / "rank-00000-of-00001.safetensors").mkdir()  # the shard's name is taken
    handle = h.save(4, rank_states(1))
    with pytest.raises(SaveError, match="step 4") as caught:
        handle.committed.result()
    assert isinstance(caught.value.__cause__, OSError)
    h.errors.raise_first()  # already raised by the handle's future: not again


def test_a_save_that_fails_after_its_shards_landed_leaves_nothing_behind(harness):
    # world_size 2 but this process holds rank 0 only, and no other rank sends its shard: the
    # manifest (one shard for two ranks) is refused after rank 0's shard is on disk
    h = harness(world_size=2, processes_ranks=1)
    handle = h.save(7, rank_states(1))
    with pytest.raises(SaveError, match="step 7") as caught:
        handle.committed.result()
    assert isinstance(caught.value.__cause__, ShardCountMismatchError)
    assert not h.store.local.step_dir(7).exists()  # the landed shard went with its directory
    assert h.store.local.steps() == [] and h.store.local.uncommitted_steps() == []


def test_a_writer_whose_tier_is_not_locked_fails_the_save_and_writes_nothing(tmp_path):
    store = TieredStore([LocalTier(tmp_path / "ckpt")])
    errors = ErrorBox()
    writer = Writer(store, SingleProcessCoordinator(1), world_size=1, errors=errors)
    try:
        flat = [flatten(rank_states(1)[0], "rank 0")]
        handle = writer.submit(1, SavePlan(tuple(flat), (), (0,)))
        with pytest.raises(SaveError) as caught:
            handle.committed.result()
        assert isinstance(caught.value.__cause__, UsageError) and "lock" in str(caught.value)
        assert not (tmp_path / "ckpt" / step_dir_name(1)).exists()
    finally:
        writer.close()


# -- retention --------------------------------------------------------------------------------------


def test_retention_after_each_commit_keeps_the_newest_steps(harness):
    h = harness(world_size=2, retention=RetentionPolicy(keep_last=2))
    for step, kept in [(1, [1]), (2, [1, 2]), (3, [2, 3]), (4, [3, 4])]:
        h.save(step, rank_states(2, step)).committed.result()
        h.writer.settle()  # and the retention after it
        assert h.store.local.steps() == kept
    assert_same(rank_states(2, 4), read_back(h.store, 4))
    assert sorted(os.listdir(h.store.local.root)) == [step_dir_name(3), step_dir_name(4)]


def test_retention_keeps_every_nth_step_too(harness):
    h = harness(world_size=1, retention=RetentionPolicy(keep_last=1, keep_every=3))
    for step in range(1, 8):
        h.save(step, rank_states(1, step)).committed.result()
    h.writer.settle()
    assert h.store.local.steps() == [3, 6, 7]


def test_a_failed_save_does_not_run_retention(harness):
    h = harness(world_size=1, retention=RetentionPolicy(keep_last=1))
    h.save(1, rank_states(1)).committed.result()
    h.store.local.step_dir(2).write_text("blocked")
    h.save(2, rank_states(1)).committed.exception()  # waits; raises nothing
    h.writer.settle()
    assert h.store.local.steps() == [1]  # only a commit makes older steps deletable
    with pytest.raises(SaveError):
        h.errors.raise_first()


def test_without_a_policy_every_step_is_kept(harness):
    h = harness(world_size=1)
    for step in range(1, 5):
        h.save(step, rank_states(1, step))
    h.writer.settle()
    assert h.store.local.steps() == [1, 2, 3, 4]


# -- CPUs and priority ---------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux's")
def test_the_background_threads_run_niced_on_the_cpus_given_and_the_caller_is_left_alone(harness):
    cpu = max(os.sched_getaffinity(0))
    before, before_nice = os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    h = harness(world_size=1, retention=RetentionPolicy(keep_last=1), cpus=frozenset({cpu}))
    h.save(1, rank_states(1)).committed.result()
    h.writer.settle()
    threads = {t.name.rsplit("_", 1)[0]: t for t in threading.enumerate() if t.name.startswith("tiered-ckpt-")}
    assert {"tiered-ckpt-writer", "tiered-ckpt-retention"} <= set(threads)
    for name in ("tiered-ckpt-writer", "tiered-ckpt-retention"):
        native = threads[name].native_id
        assert os.sched_getaffinity(native) == {cpu}
        niceness = os.getpriority(os.PRIO_PROCESS, native)
        assert niceness == min(19, before_nice + BACKGROUND_NICENESS) and (niceness > before_nice or niceness == 19)
    assert os.sched_getaffinity(0) == before
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before_nice


# -- the first stage of replication --------------------------------------------------------


def test_the_writer_hands_each_commit_to_every_next_stage(tmp_path, memory_url):
    peer, bucket = MemoryTier("peer"), RemoteTier(*memory_url)
    store = TieredStore([LocalTier(tmp_path / "ckpt"), peer, bucket])
    errors = ErrorBox()
    with store.local.lock():
        stages = [Replicator(store, peer, errors=errors), Replicator(store, errors=errors)]  # the bucket by default
        writer = Writer(store, SingleProcessCoordinator(1), world_size=1, errors=errors, replicators=stages)
        handles = []
        try:
            for step in (1, 2):
                flat = [flatten({"w": np.full(64, step, np.float32)}, "rank 0")]
                keys, numels = resolve_sharded_keys([sharding_summary(flat[0].arrays)], None, flat=True)
                handles.append(writer.submit(step, SavePlan(tuple(flat), keys, tuple(numels))))
                handles[-1].committed.result()
            writer.close()
            for stage in stages:
                stage.wait()
            errors.raise_first()
            assert [handle.uploaded.result() for handle in handles] == [None, None]  # the bucket's stage
            assert peer.steps() == bucket.steps() == [1, 2]
            assert [store.receipted(step, bucket) for step in (1, 2)] == [True, True]
            assert [store.receipted(step, peer) for step in (1, 2)] == [False, False]
        finally:
            for stage in stages:
                stage.close()


def test_a_failed_save_fails_its_upload_future_with_the_save_error(tmp_path, memory_url):
    store = TieredStore([LocalTier(tmp_path / "ckpt"), RemoteTier(*memory_url)])
    errors = ErrorBox()
    with store.local.lock():
        uploader = Replicator(store, errors=errors)
        writer = Writer(store, SingleProcessCoordinator(1), world_size=1, errors=errors, replicators=[uploader])
        try:
            store.local.step_dir(2).write_text("not a directory")  # the step's directory cannot be made
            flat = [flatten({"w": np.full(64, 2, np.float32)}, "rank 0")]
            keys, numels = resolve_sharded_keys([sharding_summary(flat[0].arrays)], None, flat=True)
            handle = writer.submit(2, SavePlan(tuple(flat), keys, tuple(numels)))
            with pytest.raises(SaveError, match="step 2") as caught:
                handle.committed.result()
            assert handle.uploaded.exception(timeout=60) is caught.value  # the step will never be uploaded
            errors.raise_first()  # raised once, by the handle
        finally:
            writer.close()
            uploader.close()
    assert store.remote.steps() == []
