import json
import logging
from pathlib import Path

import numpy as np
import pytest

from support.processes import launch_ranks
from tiered_ckpt import ConfigError, save_sharded
from tiered_ckpt.format.layout import shard_name, step_dir_name
from tiered_ckpt.tiers import pruning
from tiered_ckpt.tiers.base import ShardSource
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.tier import RemoteTier
from tiered_ckpt.tiers.retention import RetentionPolicy, awaiting, best, protected, retainable
from tiered_ckpt.tiers.store import TieredStore


@pytest.mark.parametrize(
    "policy, steps, protected, deleted",
    [
        (RetentionPolicy(), [1, 2, 3], (), []),  # keep_last=None keeps everything
        (RetentionPolicy(keep_last=2), [1, 2, 3, 4], (), [1, 2]),
        (RetentionPolicy(keep_last=1, keep_every=10), [5, 10, 15, 20, 25], (), [5, 15]),
        (RetentionPolicy(keep_last=1), [3, 1, 2], (), [1, 2]),  # any order in, oldest first out
        (RetentionPolicy(keep_last=1), [1, 2, 3], (1,), [2]),  # protected steps stay
        (RetentionPolicy(keep_last=1), [], (), []),
    ],
)
def test_policy_deletes_what_it_should(policy, steps, protected, deleted):
    assert policy.to_delete(steps, protected) == deleted


def test_the_newest_step_is_never_deleted():
    assert RetentionPolicy(keep_last=1).to_delete([7]) == []
    assert 9 not in RetentionPolicy(keep_last=1, keep_every=4).to_delete([4, 8, 9])


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "3"])
def test_bad_keep_values_are_refused_naming_the_field(value):
    with pytest.raises(ConfigError, match="keep_last") as caught:
        RetentionPolicy(keep_last=value)
    assert caught.value.field == "keep_last"
    with pytest.raises(ConfigError, match="keep_every"):
        RetentionPolicy(keep_every=value)


def test_awaiting_protects_unreceipted_pending_and_newer_steps():
    steps = [1, 2, 3, 4, 5]
    # 2 and 4 are committed remotely; 3 was skipped (superseded by 4); 5 is newer than any commit
    assert awaiting(steps, receipted={2, 4}, pending=()) == {5}
    assert awaiting(steps, receipted={2, 4}, pending=(3,)) == {3, 5}
    assert awaiting(steps, receipted=set(), pending=()) == set(steps)


def test_a_bound_protects_only_the_newest_waiting_steps_and_those_queued():
    steps = list(range(1, 11))  # the bucket has been down since step 2
    assert protected(steps, receipted={1}, pending=(), limit=None) == set(range(2, 11))
    assert protected(steps, receipted={1}, pending=(), limit=3) == {8, 9, 10}
    assert protected(steps, receipted={1}, pending=(4,), limit=3) == {4, 8, 9, 10}  # queued: kept
    policy = RetentionPolicy(keep_last=1, max_awaiting_upload=3)
    assert policy.to_delete(steps, protected(steps, {1}, (), policy.max_awaiting_upload)) == list(range(1, 8))
    with pytest.raises(ConfigError, match="max_awaiting_upload"):
        RetentionPolicy(max_awaiting_upload=0)


# --- keep-best ---


def test_best_ranks_by_value_never_counts_a_step_without_one_and_prefers_the_newer_of_equals():
    scores = {1: 0.9, 2: None, 3: 0.3, 4: 0.3, 5: 0.5}
    assert best(scores, 2, "min") == {3, 4}
    assert best(scores, 1, "min") == {4}  # of equal values, the newer step
    assert best(scores, 2, "max") == {1, 5}
    assert best(scores, 10, "max") == {1, 3, 4, 5}  # step 2 recorded none: never among the best
    assert best({}, 3, "min") == set()


def test_keep_best_keeps_the_best_beside_the_newest_and_what_else_the_policy_keeps():
    scores = {1: 0.2, 2: 0.9, 3: 0.1, 4: 0.8, 5: 0.7, 6: 0.95}
    lowest = RetentionPolicy(keep_last=1, keep_best=2, best_metric="loss")
    assert lowest.to_delete(scores, (), scores) == [2, 4, 5]  # keeps 1 and 3 (best), 6 (newest)
    highest = RetentionPolicy(keep_last=2, keep_best=1, best_metric="acc", best_mode="max")
    assert highest.to_delete(scores, (1,), scores) == [2, 3, 4]  # 6 the best and newest, 5 newest, 1 protected
    assert highest.to_delete(scores, (), {}) == [1, 2, 3, 4]  # no values known: only the newest stay
    every = RetentionPolicy(keep_last=1, keep_every=2, keep_best=1, best_metric="loss")
    assert every.to_delete(scores, (), scores) == [1, 5]  # 2, 4, 6 by keep_every, 3 the best


@pytest.mark.parametrize(
    "fields, field, problem",
    [
        ({"keep_best": 2}, "best_metric", "must be given with keep_best"),
        ({"best_metric": "loss"}, "keep_best", "must be given with best_metric"),
        ({"keep_best": 0, "best_metric": "loss"}, "keep_best", "must be >= 1"),
        ({"keep_best": 1, "best_metric": ""}, "best_metric", "must be a metric's name"),
        ({"keep_best": 1, "best_metric": 3}, "best_metric", "must be a metric's name"),
        ({"keep_best": 1, "best_metric": "loss", "best_mode": "lowest"}, "best_mode", "must be 'min' or 'max'"),
    ],
)
def test_keep_best_options_are_checked_naming_the_field(fields, field, problem):
    with pytest.raises(ConfigError, match=problem) as caught:
        RetentionPolicy(keep_last=1, **fields)
    assert caught.value.field == field


def test_keep_best_needs_keep_last_since_none_keeps_every_step():
    with pytest.raises(ConfigError, match="keep_best needs keep_last") as caught:
        RetentionPolicy(keep_best=1, best_metric="loss")
    assert caught.value.field == "keep_best"


# --- one process per rank: retention waits for a step every rank committed (real processes) ---

WORKER = Path(__file__).resolve().parents[1] / "support" / "rank_worker.py"


def run_ranks(root: Path, actions: list[dict], remote=None, killed: int | None = None) -> dict:
    """Two rank processes of one job with keep_last=1 over ``root``'s local directories."""
    config = {"actions": actions, "timeout_seconds": 60, "keep_last": 1}
    return launch_ranks(WORKER, root, 2, config, remote=remote, killed=killed)


def committed(root: Path, rank: int) -> list[int]:
    return LocalTier(root / "nodes" / f"rank-{rank}").steps()


@pytest.mark.slow
@pytest.mark.parametrize("bucket", [False, True], ids=["no-bucket", "s3"])
def test_a_rank_killed_before_its_commit_leaves_the_older_step_restorable_from_every_disk(tmp_path, request, bucket):
    remote = request.getfixturevalue("s3_url") if bucket else None
    actions = [
        {"do": "save", "step": 1},
        {"do": "wait"},
        {"do": "kill", "rank": 1, "at": "before-commit"},  # rank 1 dies just before writing its step-2 manifest
        {"do": "save", "step": 2},
        {"do": "wait"},
    ]
    survivor = run_ranks(tmp_path, actions, remote, killed=1)[0]
    assert survivor["error"][0] == "SaveError", survivor
    assert "committed in" in survivor["error"][1] and "but not on every rank" in survivor["error"][1]
    # rank 0 committed step 2 on its own: that proves nothing of rank 1, so step 1 stays on both disks
    assert committed(tmp_path, 0) == [1, 2] and committed(tmp_path, 1) == [1]

    from support import rank_worker

    relaunched = run_ranks(tmp_path, [{"do": "restore"}, {"do": "save", "step": 2}, {"do": "wait"}], remote)
    for rank, result in relaunched.items():
        assert "error" not in result, result
        assert result["restored"]["step"] == 1
        assert result["restored"]["sources"] == {str(rank): "local"}  # from each rank's own disk, no download
        assert result["restored"]["digests"] == rank_worker.digests(rank_worker.rank_state(1, 2, rank))
        # step 2, committed by every rank this time, lets retention delete step 1 everywhere
        assert committed(tmp_path, rank) == [2]


def per_rank_store(tmp_path: Path, remote=None, uploaded: tuple[int, ...] = ()) -> TieredStore:
    """Rank 0's directory of a 2-rank job holding steps 1 and 2 (its own shard of each); the
    steps ``uploaded`` are committed in ``remote`` with their receipts."""
    root = tmp_path / "rank-0"
    store = TieredStore([LocalTier(root), *([RemoteTier(*remote)] if remote is not None else [])])
    for step in (1, 2):
        states = [{"w": np.arange(64, dtype=np.float32) + step}, {"w": np.zeros(64, dtype=np.float32)}]
        directory = root / step_dir_name(step)
        manifest = save_sharded(states, directory, step)
        with store.local.lock():
            if step in uploaded:
                landed = [
                    store.remote.land_shard(step, record, ShardSource(path=directory / record.path))
                    for record in manifest.shards
                ]
                store.local.write_receipt(step, store.remote.url, store.remote.commit(manifest, landed=landed))
            (directory / shard_name(1, 2)).unlink()
            store.local.record_held(step, manifest, [0])  # rank 1's shard is on its node
    return store


def test_retention_of_a_rank_directory_deletes_only_below_a_step_every_rank_committed(tmp_path):
    store = per_rank_store(tmp_path)
    store.retention = {"local": RetentionPolicy(keep_last=1)}
    with store.local.lock():
        assert pruning.to_delete(store, store.local) == []  # step 2 is this rank's commit only
        assert pruning.retain(store, store.local) == [] and store.local.steps() == [1, 2]
        assert pruning.retain(store, store.local, complete=2) == [1]  # the ranks agreed on step 2's commit
        assert store.local.steps() == [2]


@pytest.mark.parametrize("uploaded", [(), (1,)], ids=["bucket-empty", "step-1-in-bucket"])
def test_retention_after_a_remote_commit_never_counts_this_ranks_own_newer_commit(tmp_path, memory_url, uploaded):
    """The uploader's pass after a remote commit (no step agreed by the writer): only a step in
    the bucket is known complete on every rank; step 2 is this rank's own commit."""
    store = per_rank_store(tmp_path, memory_url, uploaded)
    with store.local.lock():
        store.retention = {"local": RetentionPolicy(keep_last=1)}
        assert pruning.retain(store, store.local) == []
        store.retention = {"local": RetentionPolicy(keep_last=1, max_awaiting_upload=1)}
        assert pruning.retain(store, store.local) == []
        assert store.local.steps() == [1, 2]
        # once the ranks agreed on step 2, step 1 may go (with max_awaiting_upload=1 even unuploaded)
        assert pruning.retain(store, store.local, complete=2) == [1]


def test_only_steps_no_newer_than_the_newest_complete_one_are_weighed():
    assert retainable([3, 1, 2], None) == []
    assert retainable([3, 1, 2], 2) == [1, 2]
    assert RetentionPolicy(keep_last=1).to_delete(retainable([1, 2, 3], 2)) == [1]  # 3 is kept, uncounted


def test_an_upload_cadence_below_one_is_refused():
    with pytest.raises(ConfigError, match="upload_every must be an integer >= 1"):
        RetentionPolicy(upload_every=0)


@pytest.mark.slow
def test_ranks_keep_the_best_steps_by_rank_0s_metrics_and_a_bad_metric_fails_every_rank(tmp_path):
    losses = {1: 0.5, 2: 0.2, 3: 0.9, 4: 0.1, 5: 0.6}
    saves = [
        {"do": "save", "step": step, "metrics_by_rank": {"0": {"loss": loss}, "1": {"loss": 1 - loss}}}
        for step, loss in losses.items()
    ]
    bad = {"do": "save", "step": 6, "metrics_by_rank": {"0": {"loss": 0.3}, "1": {"loss": "0.3"}}}
    config = {"actions": [*saves, {"do": "steps"}, bad], "timeout_seconds": 60, "keep_last": 1}
    config["keep_best"] = [2, "loss", "min"]
    results = launch_ranks(WORKER, tmp_path, 2, config)
    for rank in (0, 1):
        assert results[rank]["steps"] == [2, 4, 5]  # rank 0's two lowest losses, and the newest
        assert committed(tmp_path, rank) == [2, 4, 5]  # step 6 was not saved
        manifest = LocalTier(tmp_path / "nodes" / f"rank-{rank}").manifest(4)
        assert manifest.metrics == (("loss", 0.1),)
    (kind, message), (other_kind, other_message) = results[1]["error"], results[0]["error"]
    assert kind == other_kind == "InvalidStateError" and "metrics['loss'] must be a real number" in message
    assert "rank 1" in other_message  # rank 0 raises too, naming the rank at fault


def test_a_step_whose_manifest_cannot_be_read_now_is_kept_and_ranked_once_it_can(tmp_path, caplog):
    from support.memory_tier import MemoryTier
    from tiered_ckpt.errors import RemoteError
    from tiered_ckpt.tiers.step_metrics import StepMetrics

    class Blinking(MemoryTier):
        down: set[int] = set()

        def manifest(self, step):
            if step in self.down:
                raise RemoteError(f"step {step}: connection reset", transient=True)
            return super().manifest(step)

    tier = Blinking("bucket")
    for step, loss in ((1, 0.1), (2, 0.5), (3, 0.7)):
        manifest = save_sharded([{"w": np.full(4, step, np.float32)}], tmp_path / str(step), step=step)
        document = manifest.to_dict() | {"schema_version": 4, "metrics": {"loss": loss}}
        tier.manifests[step] = json.dumps(document).encode()
    metrics, policy = StepMetrics(), RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss")
    tier.down = {1}
    with caplog.at_level(logging.WARNING):
        scores, unknown = metrics.scores(tier, [1, 2, 3], "loss")
    assert (scores, unknown) == ({2: 0.5, 3: 0.7}, {1}) and "keeps step 1: its metrics could not be read" in caplog.text
    assert policy.to_delete([1, 2, 3], unknown, scores) == []  # 1 unknown: kept, and 2 is the best known
    tier.down = set()
    scores, unknown = metrics.scores(tier, [1, 2, 3], "loss")
    assert (scores, unknown) == ({1: 0.1, 2: 0.5, 3: 0.7}, set())
    assert policy.to_delete([1, 2, 3], unknown, scores) == [2]
    metrics.forget(tier, 1)
    tier.down = {1}
    assert metrics.scores(tier, [1], "loss") == ({}, {1})  # read again after forgetting: down again
