"""The restorer (tiered_ckpt.engine.restore) on its own: a Restorer over a LocalTier-backed store
with a SingleProcessCoordinator, no manager; and its argument checks and result."""

import numpy as np
import pytest

from support.states import flip_byte
from tiered_ckpt.dist.coordination import SingleProcessCoordinator
from tiered_ckpt.engine.restore import Restorer, check_restore_arguments
from tiered_ckpt.engine.restore_result import RestoreResult
from tiered_ckpt.engine.shards import build_manifest, write_shards
from tiered_ckpt.engine.step_choice import same_call
from tiered_ckpt.errors import (
    ChecksumMismatchError,
    ConfigError,
    IncompleteCheckpointError,
    InvalidStateError,
    UsageError,
    WorldSizeMismatchError,
)
from tiered_ckpt.format.state import flatten
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.store import TieredStore


def rank_states(world_size, step):
    return [
        {"w": np.arange(1000, dtype=np.float32) * (rank + 1) + step, "meta": {"step": step, "rank": rank}}
        for rank in range(world_size)
    ]


@pytest.fixture
def store(tmp_path):
    store = TieredStore([LocalTier(tmp_path / "ckpt")])
    with store.local.lock():
        yield store


def commit(store, step, world_size):
    """Write and commit ``step`` of ``world_size`` ranks in ``store``'s local tier, as the writer does."""
    flat = [flatten(state, f"rank {rank}") for rank, state in enumerate(rank_states(world_size, step))]
    records = write_shards(store.local, step, flat, range(world_size), world_size=world_size, numels=[0] * world_size)
    manifest = build_manifest(step, records, world_size=world_size, sharded_keys=(), wall_clock_seconds=1.0)
    store.local.commit(manifest, agreed=None)
    return manifest


def restore(store, step=None, *, world_size=2, missing_ok=False, verify="full", into=None, reshard=False):
    restorer = Restorer(store, SingleProcessCoordinator(world_size), world_size)
    return restorer.restore(
        step, world_size=world_size, reshard=reshard, verify=verify, into=into, missing_ok=missing_ok
    )


def assert_states(expected, got):
    assert len(expected) == len(got)
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_array_equal(want["w"], have["w"])
        assert want["meta"] == have["meta"]


# -- choosing the step ----------------------------------------------------------------------------


def test_the_newest_committed_step_is_restored_with_every_rank_and_where_each_came_from(store):
    for step in (1, 2, 3):
        manifest = commit(store, step, 2)
    result = restore(store)
    assert isinstance(result, RestoreResult) and result.step == 3 and result.ranks == (0, 1)
    assert result.manifest == manifest and result.sources == {0: "local", 1: "local"}
    assert result.bytes_read == sum(record.size_bytes for record in manifest.shards)
    assert_states(rank_states(2, 3), result.states)


def test_a_step_asked_for_is_the_one_restored(store):
    for step in (1, 2, 3):
        commit(store, step, 2)
    assert_states(rank_states(2, 2), restore(store, 2).states)


def test_a_step_that_is_not_committed_is_refused_naming_the_committed_ones(store):
    commit(store, 1, 2)
    commit(store, 4, 2)
    with pytest.raises(IncompleteCheckpointError, match=r"\[1, 4\]"):
        restore(store, 3)


def test_an_uncommitted_newer_step_is_passed_over(store):
    commit(store, 1, 2)
    flat = [flatten(state, f"rank {rank}") for rank, state in enumerate(rank_states(2, 2))]
    write_shards(store.local, 2, flat, range(2), world_size=2, numels=[0, 0])  # shards, but no manifest
    assert restore(store).step == 1


def test_nothing_to_restore_is_none_with_missing_ok_and_an_error_without(store):
    assert restore(store, missing_ok=True) is None
    with pytest.raises(IncompleteCheckpointError):
        restore(store)


def test_another_world_size_is_refused_unless_resharded(store):
    commit(store, 5, 2)
    with pytest.raises(WorldSizeMismatchError, match="2"):
        restore(store, world_size=4)


# -- verification ------------------------------------------------------------------------------------


@pytest.mark.parametrize("verify", ["full", "fast"])
def test_a_flipped_byte_in_a_local_shard_without_a_bucket_is_refused_naming_the_shard(store, verify):
    manifest = commit(store, 1, 2)
    path = store.local.shard_path(1, manifest.shard(1))
    flip_byte(path, path.stat().st_size - 10)
    with pytest.raises(ChecksumMismatchError) as caught:
        restore(store, verify=verify)
    assert manifest.shard(1).path in str(caught.value)


def test_a_missing_shard_without_a_bucket_is_an_incomplete_checkpoint(store):
    manifest = commit(store, 1, 2)
    store.local.shard_path(1, manifest.shard(0)).unlink()
    with pytest.raises(IncompleteCheckpointError, match="rank 0|rank-00000"):
        restore(store)


def test_into_fills_the_callers_arrays(store):
    commit(store, 1, 2)
    into = [{"w": np.zeros(1000, dtype=np.float32), "meta": {"step": 0, "rank": 0}} for _ in range(2)]
    result = restore(store, into=into)
    for rank in range(2):
        np.testing.assert_array_equal(into[rank]["w"], rank_states(2, 1)[rank]["w"])
    assert result.step == 1


# -- locate --------------------------------------------------------------------------------------


def test_locate_gives_the_manifest_of_the_newest_step_or_of_the_one_asked_for(store):
    first = commit(store, 1, 2)
    newest = commit(store, 2, 2)
    restorer = Restorer(store, SingleProcessCoordinator(2), 2)
    assert restorer.locate(None) == newest and restorer.locate(1) == first
    with pytest.raises(IncompleteCheckpointError):
        restorer.locate(7)


# -- arguments and results --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, problem",
    [
        ((-1, 1, "full", None), "step must be None or an integer >= 0"),
        ((True, 1, "full", None), "step must be None"),
        (("3", 1, "full", None), "step must be None"),
        ((1.0, 1, "full", None), "step must be None"),
        ((None, 0, "full", None), "world_size must be an integer >= 1"),
        ((None, True, "full", None), "world_size must be"),
        ((None, None, "full", None), "world_size must be"),
        ((None, 1, "full", "into"), "into must be a dict of arrays or a list of them, got str"),
        ((None, 1, "full", 3), "into must be a dict of arrays or a list of them, got int"),
    ],
)
def test_bad_restore_arguments_are_a_usage_error_naming_the_argument(arguments, problem):
    with pytest.raises(UsageError, match=f"^restore: {problem}"):
        check_restore_arguments(*arguments)


def test_a_bad_verify_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="verify"):
        check_restore_arguments(None, 1, "sometimes", None)


@pytest.mark.parametrize("arguments", [(None, 1, "full", None), (0, 8, "fast", {}), (3, 2, "full", [{}, {}])])
def test_good_restore_arguments_pass(arguments):
    check_restore_arguments(*arguments)


def test_ranks_that_called_with_different_arguments_are_refused_showing_each_ranks():
    same_call(['{"step": 1}', '{"step": 1}'], "restore")
    with pytest.raises(
        InvalidStateError, match=r"restore with different arguments: \{0: \{'step': 1\}, 1: \{'step': 2\}"
    ):
        same_call(['{"step": 1}', '{"step": 2}'], "restore")


def test_state_of_a_result_holding_several_ranks_says_to_use_states(store):
    commit(store, 1, 2)
    result = restore(store)
    with pytest.raises(UsageError, match="holds 2 ranks; use .states"):
        result.state  # noqa: B018
    commit(store, 2, 1)
    single = restore(store, 2, world_size=1)
    assert single.state["meta"] == {"step": 2, "rank": 0}
