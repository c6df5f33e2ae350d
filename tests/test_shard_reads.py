"""Reading this process's part of a step through the store (tiered_ckpt.engine.shard_reads)."""

import shutil

import numpy as np
import pytest

from conftest import flip_byte
from tiered_ckpt import (
    CheckpointManager,
    ChecksumMismatchError,
    RemoteOptions,
    RuntimeOptions,
    UsageError,
    WorldSizeMismatchError,
)
from tiered_ckpt.engine.restore_result import RestoreResult
from tiered_ckpt.engine.shard_reads import ShardReader
from tiered_ckpt.format.layout import shard_name, step_dir_name
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote import RemoteTier
from tiered_ckpt.tiers.store import TieredStore


def states(world_size: int) -> list[dict[str, np.ndarray]]:
    """Per rank, one flat slice of a 12-element weight (so it reshards) and a replicated scalar."""
    return [{"w": np.arange(12, dtype=np.float32)[rank * 12 // world_size : (rank + 1) * 12 // world_size],
             "step": np.asarray(7)} for rank in range(world_size)]  # fmt: skip


@pytest.fixture
def saved(tmp_path, memory_url):
    """Step 3 of 2 ranks in ``tmp_path/node``, uploaded to a memory bucket; the store over both tiers."""
    url, options = memory_url
    node = tmp_path / "node"
    with CheckpointManager(
        node,
        world_size=2,
        remote=RemoteOptions(url, storage_options=options),
        runtime=RuntimeOptions(sharded_keys=["w"]),
    ) as manager:
        manager.save(3, states(2), blocking=True)
        manager.wait(uploaded=True)
    tier = LocalTier(tmp_path / "node")
    with tier.lock():
        yield TieredStore([tier, RemoteTier(url, options)])


def test_a_read_of_every_rank_returns_the_verified_states_and_each_shards_tier(saved):
    flip_byte(saved.local.step_dir(3) / shard_name(1, 2), 200)
    result = ShardReader(saved, range(2), 2).load(3, True, 2, False, "full", None)
    assert isinstance(result, RestoreResult)
    assert result.ranks == (0, 1) and result.sources == {0: "local", 1: "remote"}
    assert [state["w"].tolist() for state in result.states] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert result.bytes_read == result.manifest.total_bytes
    again = ShardReader(saved, range(2), 2).load(3, True, 2, False, "fast", None)  # the local copy was refilled
    assert again.sources == {0: "local", 1: "local"}


def test_a_read_for_another_world_size_reshards_only_when_asked(saved):
    reader = ShardReader(saved, range(3), 3)
    with pytest.raises(WorldSizeMismatchError, match="^restore of step 3: "):
        reader.load(3, True, 3, False, "full", None)
    result = reader.load(3, True, 3, True, "full", None)
    assert isinstance(result, RestoreResult) and result.ranks == (0, 1, 2)
    assert [state["w"].tolist() for state in result.states] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_a_read_into_the_callers_arrays_fills_them_and_refuses_into_with_reshard(saved):
    into = [{"w": np.zeros(6, np.float32), "step": np.zeros((), np.int64)} for _ in range(2)]
    reader = ShardReader(saved, range(2), 2)
    result = reader.load(3, False, 2, False, "full", into)
    assert isinstance(result, RestoreResult) and into[1]["w"].tolist() == [6, 7, 8, 9, 10, 11]
    with pytest.raises(UsageError, match="^restore of step 3: into cannot be combined with reshard=True"):
        ShardReader(saved, range(3), 3).load(3, True, 3, True, "full", into)


def test_a_step_only_the_bucket_holds_refills_the_local_tier_and_a_failed_refill_leaves_no_directory(saved):
    step_dir = saved.local.step_dir(3)
    shutil.rmtree(step_dir)
    result = ShardReader(saved, range(2), 2).load(3, True, 2, False, "full", None)
    assert result.sources == {0: "remote", 1: "remote"}
    assert saved.local.steps() == [3]  # refilled and committed again
    shutil.rmtree(step_dir)
    record = result.manifest.shard(1)
    remote_path = f"{saved.remote.backend.root}/{step_dir_name(3)}/{record.path}"
    data = bytearray(saved.remote.backend.fs.cat_file(remote_path))
    data[200] ^= 0xFF
    saved.remote.backend.fs.pipe_file(remote_path, bytes(data))
    with pytest.raises(ChecksumMismatchError, match="^restore of step 3: "):
        ShardReader(saved, range(2), 2).load(3, True, 2, False, "full", None)
    assert not step_dir.exists() and saved.local.steps() == []
