"""The one executor of a restore's plan (tiered_ckpt.engine.read_execution), run on plans the
planner made, against a real disk and a bucket."""

import numpy as np
import pytest

from support.states import flip_byte
from tiered_ckpt import CheckpointManager, InvalidStateError, RemoteOptions
from tiered_ckpt.engine.node_shards import step_holdings
from tiered_ckpt.engine.read_execution import ReadExecutor
from tiered_ckpt.engine.restore_plan import RestoreRequest, plan_parts, plan_selected_restore
from tiered_ckpt.format.shardfile import read_header
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.tier import RemoteTier
from tiered_ckpt.tiers.store import TieredStore


def state(rank: int) -> dict:
    return {"model": {"w": np.arange(256, dtype=np.float32) + rank, "b": np.full(8, rank, np.int64)}, "step": 3}


@pytest.fixture
def store(tmp_path, memory_url):
    """Step 3 of 2 ranks on ``tmp_path/node``, uploaded to a memory bucket; the store over both tiers."""
    url, options = memory_url
    with CheckpointManager(tmp_path / "node", world_size=2, remote=RemoteOptions(url, storage_options=options)) as m:
        m.save(3, [state(0), state(1)], blocking=True)
        m.wait(uploaded=True)
    tier = LocalTier(tmp_path / "node")
    with tier.lock():
        yield TieredStore([tier, RemoteTier(url, options)])


def offset_of(store: TieredStore, rank: int, name: str) -> int:
    record = store.local.manifest(3).shard(rank)
    path = store.local.shard_path(3, record)
    return read_header(path.read_bytes()[: record.header_bytes], record.size_bytes, str(path)).arrays[name].begin


def test_named_parts_fill_the_given_arrays_verified_and_a_damaged_one_comes_from_the_next_tier(store):
    manifest = store.local.manifest(3)
    path = store.local.shard_path(3, manifest.shard(1))
    flip_byte(path, offset_of(store, 1, "model/w") + 4)
    holdings = step_holdings(store, True, manifest, range(2), {"remote": True})
    into = {rank: {"model/w": np.zeros(256, np.float32)} for rank in range(2)}
    done = ReadExecutor(store).run(manifest, plan_parts(holdings, {0: {"model/w"}, 1: {"model/w"}}), into=into)
    assert done.sources == {0: "local", 1: "remote"}
    for rank in range(2):
        assert done.states[rank].arrays["model/w"] is into[rank]["model/w"]
        np.testing.assert_array_equal(into[rank]["model/w"], state(rank)["model"]["w"])
    assert done.bytes_read == sum(manifest.shard(rank).header_bytes + 256 * 4 for rank in range(2))
    assert done.refills == ()  # parts of shards are not a copy of the step


def test_a_selection_checks_every_ranks_arrays_before_it_fills_any(store):
    manifest = store.local.manifest(3)
    request = RestoreRequest((0, 1), 2, True, into=2)
    holdings = step_holdings(store, True, manifest, range(2), {"remote": True})
    plan = plan_selected_restore(manifest, request, holdings, [("model", "w")])
    good = np.full(256, -1, np.float32)
    into = {0: {"model/w": good}, 1: {"model/w": np.zeros(255, np.float32)}}  # rank 1's is one short
    with pytest.raises(InvalidStateError, match=r"into\[1\] does not hold the arrays of the selected paths"):
        ReadExecutor(store).run(manifest, plan.reads, into=into, paths=plan.paths)
    assert (good == -1).all()  # rank 0's array was left as it was
    into[1]["model/w"] = np.zeros(256, np.float32)
    done = ReadExecutor(store).run(manifest, plan.reads, into=into, paths=plan.paths)
    assert set(done.states[1].arrays) == {"model/w"} and done.starts[0]
    np.testing.assert_array_equal(into[1]["model/w"], state(1)["model"]["w"])
