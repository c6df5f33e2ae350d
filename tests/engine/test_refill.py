"""A restore's refill of the local disk from copies in memory, landed after the restore returned, on real files."""

import logging

import numpy as np
import pytest

from tiered_ckpt import save_sharded
from tiered_ckpt.engine.refill import Refill, Refiller
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.store import TieredStore


@pytest.fixture
def copies(tmp_path):
    """Step 5 of 2 ranks saved elsewhere: its manifest and each shard's bytes, as a partner's memory holds them."""
    states = [{"w": np.arange(8192, dtype=np.float32) * (rank + 1)} for rank in range(2)]
    source = tmp_path / "elsewhere" / step_dir_name(5)
    manifest = save_sharded(states, source, step=5)
    data = {record.rank: memoryview((source / record.path).read_bytes()) for record in manifest.shards}
    return manifest, data


def test_a_refill_lands_only_when_its_queue_runs_it_then_commits_the_step_with_its_ranks(tmp_path, copies):
    manifest, data = copies
    store = TieredStore([LocalTier(tmp_path / "disk")])
    queued = []
    refiller = Refiller(store, queued.append)
    with store.local.lock():
        store.local.new_step_dir(5)
        refill = Refill(manifest, None, (0, 1), False, True, tuple((manifest.shard(r), data[r]) for r in (0, 1)))
        refiller.start([refill])
        assert len(queued) == 1 and store.local.steps() == []  # nothing landed before the queue ran it
        queued[0]()
        assert store.local.steps() == [5]
        assert store.local.held_ranks(5, store.local.manifest(5)) == [0, 1]
        assert [store.local.check_shard(5, record) for record in manifest.shards] == [None, None]
    assert refiller.last_error is None


def test_a_failed_refill_is_logged_and_kept_for_lag_never_raised_and_its_directory_removed(tmp_path, copies, caplog):
    manifest, data = copies
    store = TieredStore([LocalTier(tmp_path / "disk")])
    refiller = Refiller(store)  # at once, on this thread
    with store.local.lock():
        step_dir = store.local.new_step_dir(5)
        (step_dir / manifest.shard(1).path).mkdir()  # a directory where the shard's file must go: the landing fails
        refill = Refill(manifest, None, (0, 1), False, True, tuple((manifest.shard(r), data[r]) for r in (0, 1)))
        with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
            refiller.start([refill])
        assert store.local.steps() == []  # not committed with a shard missing
        assert not step_dir.exists()  # the directory the restore made is gone again
    assert refiller.last_error is not None
    assert "step 5" in refiller.last_error and str(tmp_path / "disk") in refiller.last_error
    assert any("refilling" in record.getMessage() for record in caplog.records if record.levelno == logging.WARNING)


def test_a_refill_into_a_step_committed_here_before_records_the_rank_it_adds(tmp_path, copies):
    manifest, data = copies
    store = TieredStore([LocalTier(tmp_path / "disk")])
    with store.local.lock():
        store.local.new_step_dir(5)
        Refiller(store).start([Refill(manifest, None, (0,), False, True, ((manifest.shard(0), data[0]),))])
        assert store.local.held_ranks(5, store.local.manifest(5)) == [0]
        Refiller(store).start([Refill(manifest, None, (1,), True, False, ((manifest.shard(1), data[1]),))])
        assert store.local.held_ranks(5, store.local.manifest(5)) == [0, 1]
        assert store.local.check_shard(5, manifest.shard(1)) is None


def test_bytes_changed_after_their_check_are_caught_as_they_land_and_nothing_is_committed(tmp_path, copies):
    manifest, data = copies
    store = TieredStore([LocalTier(tmp_path / "disk")])
    queued = []
    refiller = Refiller(store, queued.append)
    changing = bytearray(data[0])  # memory its tier may reuse before the refill runs
    with store.local.lock():
        store.local.new_step_dir(5)
        refiller.start([Refill(manifest, None, (0,), False, True, ((manifest.shard(0), memoryview(changing)),))])
        changing[len(changing) // 2] ^= 0x01
        queued[0]()
        assert store.local.steps() == [] and not store.local.step_dir(5).exists()
    assert refiller.last_error is not None and "rank 0" in refiller.last_error


def test_a_refill_failing_for_any_reason_raises_nothing_to_the_queue_that_runs_it(tmp_path, copies):
    manifest, data = copies
    store = TieredStore([LocalTier(tmp_path / "disk")])
    queued = []
    refiller = Refiller(store, queued.append)
    released = memoryview(bytes(data[0]))
    with store.local.lock():
        store.local.new_step_dir(5)
        refiller.start([Refill(manifest, None, (0,), False, True, ((manifest.shard(0), released),))])
        released.release()  # reading it now raises ValueError, not an OSError
        queued[0]()
        assert store.local.steps() == []
    assert refiller.last_error is not None and "step 5" in refiller.last_error
