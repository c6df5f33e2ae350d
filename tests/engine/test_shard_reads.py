"""Reading this process's part of a step through the store (tiered_ckpt.engine.shard_reads), then
assembling the result (tiered_ckpt.engine.assembly)."""

import shutil

import numpy as np
import pytest

from support.states import flip_byte
from tiered_ckpt import (
    CheckpointManager,
    ChecksumMismatchError,
    InvalidStateError,
    RemoteOptions,
    RuntimeOptions,
    UsageError,
    WorldSizeMismatchError,
)
from tiered_ckpt.engine.assembly import assemble
from tiered_ckpt.engine.restore_result import RestoreResult
from tiered_ckpt.engine.shard_reads import ShardReader
from tiered_ckpt.format.layout import shard_name, step_dir_name
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.tier import RemoteTier
from tiered_ckpt.tiers.store import TieredStore

BUCKET = {"remote": True}  # the bucket committed the step
NOT_IN_BUCKET = {"remote": False}


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
    result = assemble(ShardReader(saved, range(2), 2).load(3, BUCKET, 2, False, "full", None), {})
    assert isinstance(result, RestoreResult)
    assert result.ranks == (0, 1) and result.sources == {0: "local", 1: "remote"}
    assert [state["w"].tolist() for state in result.states] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert result.bytes_read == result.manifest.total_bytes
    reader = ShardReader(saved, range(2), 2)
    again = assemble(reader.load(3, BUCKET, 2, False, "fast", None), {})  # the local copy was refilled
    assert again.sources == {0: "local", 1: "local"}


def test_a_read_for_another_world_size_reshards_only_when_asked(saved):
    reader = ShardReader(saved, range(3), 3)
    with pytest.raises(WorldSizeMismatchError, match="^restore of step 3: "):
        reader.load(3, BUCKET, 3, False, "full", None)
    result = assemble(reader.load(3, BUCKET, 3, True, "full", None), {})
    assert isinstance(result, RestoreResult) and result.ranks == (0, 1, 2)
    assert [state["w"].tolist() for state in result.states] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_a_read_into_the_callers_arrays_fills_them_and_refuses_into_with_reshard(saved):
    into = [{"w": np.zeros(6, np.float32), "step": np.zeros((), np.int64)} for _ in range(2)]
    reader = ShardReader(saved, range(2), 2)
    result = assemble(reader.load(3, NOT_IN_BUCKET, 2, False, "full", into), {})
    assert isinstance(result, RestoreResult) and into[1]["w"].tolist() == [6, 7, 8, 9, 10, 11]
    with pytest.raises(UsageError, match="^restore of step 3: into cannot be combined with reshard=True"):
        ShardReader(saved, range(3), 3).load(3, BUCKET, 3, True, "full", into)


def test_a_step_only_the_bucket_holds_refills_the_local_tier_and_a_failed_refill_leaves_no_directory(saved):
    step_dir = saved.local.step_dir(3)
    shutil.rmtree(step_dir)
    result = assemble(ShardReader(saved, range(2), 2).load(3, BUCKET, 2, False, "full", None), {})
    assert result.sources == {0: "remote", 1: "remote"}
    assert saved.local.steps() == [3]  # refilled and committed again
    shutil.rmtree(step_dir)
    record = result.manifest.shard(1)
    remote_path = f"{saved.remote.backend.root}/{step_dir_name(3)}/{record.path}"
    data = bytearray(saved.remote.backend.fs.cat_file(remote_path))
    data[200] ^= 0xFF
    saved.remote.backend.fs.pipe_file(remote_path, bytes(data))
    with pytest.raises(ChecksumMismatchError, match="^restore of step 3: "):
        ShardReader(saved, range(2), 2).load(3, BUCKET, 2, False, "full", None)
    assert not step_dir.exists() and saved.local.steps() == []


# -- partial restore: only the arrays under the paths asked for are read, each verified -----


def nested(rank: int) -> dict:
    return {
        "model": {"w": np.arange(4096, dtype=np.float32) + rank, "b": np.full(16, rank, np.float64), "version": 2},
        "optim": {"state": {0: {"exp_avg": np.full(3 * 4096, 0.5 + rank, np.float32)}}, "lr": 0.1},
        "step": 7,
    }


def where_in_shard(tier: LocalTier, step: int, rank: int, name: str) -> tuple[str, int]:
    """The shard file of ``rank`` and the offset of ``name``'s first byte in it."""
    from tiered_ckpt.format.shardfile import read_header

    record = tier.manifest(step).shard(rank)
    path = tier.shard_path(step, record)
    header = read_header(path.read_bytes()[: record.header_bytes], record.size_bytes, str(path))
    return str(path), header.arrays[name].begin


def test_a_partial_restore_reads_only_the_arrays_asked_for_and_returns_them_nested_as_saved(tmp_path):
    with CheckpointManager(tmp_path, world_size=2) as manager:
        manager.save(5, [nested(0), nested(1)], blocking=True)
        manifest = manager.locate(5)
        # damage what the selection leaves out: a restore that read it would fail
        path, offset = where_in_shard(manager._parts.store.local, 5, 1, "optim/state/#0/exp_avg")
        flip_byte(tmp_path / step_dir_name(5) / path, offset + 100)
        result = manager.restore(paths=["model"])
        with pytest.raises(ChecksumMismatchError, match="rank 1"):
            manager.restore()
    for rank, state in enumerate(result.states):
        assert set(state) == {"model"} and state["model"]["version"] == 2
        np.testing.assert_array_equal(state["model"]["w"], nested(rank)["model"]["w"])
        np.testing.assert_array_equal(state["model"]["b"], nested(rank)["model"]["b"])
    headers = sum(record.header_bytes for record in manifest.shards)
    assert result.bytes_read == headers + 2 * (4096 * 4 + 16 * 8) < manifest.total_bytes / 3


def test_a_flipped_byte_in_an_array_asked_for_is_caught_naming_the_array(tmp_path):
    with CheckpointManager(tmp_path, world_size=2) as manager:
        manager.save(5, [nested(0), nested(1)], blocking=True)
        path, offset = where_in_shard(manager._parts.store.local, 5, 0, "model/w")
        flip_byte(tmp_path / step_dir_name(5) / path, offset + 8)
        with pytest.raises(ChecksumMismatchError, match=r"rank 0 shard .*'model/w'.* xxh3-64"):
            manager.restore(paths=[("model", "w")])
        assert manager.restore(paths=[("model", "b")]).states[0]["model"]["b"][0] == 0  # the rest still reads


def test_a_partial_restore_from_the_bucket_reads_ranges_and_fills_into(tmp_path, s3_url):
    url, options = s3_url
    with CheckpointManager(tmp_path / "a", world_size=2, remote=RemoteOptions(url, storage_options=options)) as a:
        a.save(5, [nested(0), nested(1)], blocking=True)
        a.wait(uploaded=True)
    shutil.rmtree(tmp_path / "a")  # a new node: only the bucket holds the step
    into = [{"optim": {"state": {0: {"exp_avg": np.empty(3 * 4096, np.float32)}}}} for _ in range(2)]
    with CheckpointManager(tmp_path / "b", world_size=2, remote=RemoteOptions(url, storage_options=options)) as b:
        result = b.restore(paths=[("optim", "state")], into=into)
        assert b.steps() == []  # parts of shards are not a local copy of the step
    assert result.sources == {0: "remote", 1: "remote"}
    for rank in range(2):
        assert result.states[rank]["optim"]["state"][0]["exp_avg"] is into[rank]["optim"]["state"][0]["exp_avg"]
        np.testing.assert_array_equal(into[rank]["optim"]["state"][0]["exp_avg"], np.full(3 * 4096, 0.5 + rank))


def test_an_into_that_does_not_hold_the_selection_is_refused_naming_the_difference(tmp_path):
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(5, nested(0), blocking=True)
        with pytest.raises(InvalidStateError, match=r"into\[0\] does not hold the arrays .*'model/b'"):
            manager.restore(paths=["model"], into={"model": {"w": np.empty(4096, np.float32)}})


def test_a_step_saved_without_per_array_digests_is_read_whole_and_cut(tmp_path, s3_url):
    import json

    from tiered_ckpt.format.layout import MANIFEST_NAME

    url, options = s3_url
    remote = RemoteOptions(url, storage_options=options)
    with CheckpointManager(tmp_path / "a", world_size=1, remote=remote) as manager:
        manager.save(5, nested(0), blocking=True)
    path = tmp_path / "a" / step_dir_name(5) / MANIFEST_NAME
    document = json.loads(path.read_text())
    assert len(document["shards"][0].pop("array_xxh3_64")) == 16 * 3  # one digest per array: w, b, exp_avg
    path.write_text(json.dumps(document))  # as a step saved before the digests were recorded
    into = {"model": {"w": np.empty(4096, np.float32), "b": np.empty(16), "version": 0}}
    with CheckpointManager(tmp_path / "a", world_size=1) as manager:
        result = manager.restore(paths=["model"], into=into)
    assert result.bytes_read == manifest_size(tmp_path / "a", 5)  # the whole shard, verified by its sha256
    assert result.state["model"]["w"] is into["model"]["w"] and into["model"]["w"][5] == 5
    assert set(result.state) == {"model"} and result.state["model"]["version"] == 2
    shutil.rmtree(tmp_path / "a")  # a new node, and the bucket's record without digests too
    bucket = RemoteTier(url, options)
    remote_path = bucket.location(5, MANIFEST_NAME)
    document = json.loads(bucket.backend.fs.cat_file(remote_path))
    document["shards"][0].pop("array_xxh3_64")
    bucket.backend.fs.pipe_file(remote_path, json.dumps(document).encode())
    with CheckpointManager(tmp_path / "b", world_size=1, remote=remote) as manager:
        b = manager.restore(paths=[("optim", "state", 0)])
        assert manager.steps() == [5]  # read whole from the bucket: landed, as a whole shard is
    assert b.sources == {0: "remote"} and set(b.state["optim"]["state"][0]) == {"exp_avg"}


def manifest_size(root, step: int) -> int:
    return LocalTier(root).manifest(step).total_bytes


def test_a_part_of_flat_shards_reshards_onto_another_world_size(tmp_path):
    flat = np.arange(1200, dtype=np.float32)
    states = [
        {"model": {"flat": flat[r * 400 : (r + 1) * 400], "embed": np.eye(3)}, "optim": {"m": flat[:400] * 0 + r}}
        for r in range(3)
    ]
    runtime = RuntimeOptions(sharded_keys=[("model", "flat"), ("optim", "m")])
    with CheckpointManager(tmp_path, world_size=3, runtime=runtime) as manager:
        manager.save(5, states, blocking=True)
        result = manager.restore(paths=["model"], world_size=2, reshard=True)  # an eval job on 2 ranks
        with pytest.raises(UsageError, match="paths with reshard=True takes no into="):
            manager.restore(paths=["model"], world_size=2, reshard=True, into=[{}, {}])
    assert [set(state) for state in result.states] == [{"model"}, {"model"}]
    np.testing.assert_array_equal(np.concatenate([s["model"]["flat"] for s in result.states]), flat)
    assert all(np.array_equal(s["model"]["embed"], np.eye(3)) for s in result.states)


def into_for(rank: int, refusal: str) -> dict:
    """Arrays for ``paths=["model"]`` of ``nested(rank)``, each full of a marker; rank 1's refused for ``refusal``."""
    into: dict = {"model": {"w": np.full(4096, -7, np.float32), "b": np.full(16, -7, np.float64)}}
    if rank == 1 and refusal == "whole nesting":  # the whole state's nesting, not the selection's
        into["optim"] = {"state": {0: {"exp_avg": np.full(3 * 4096, -7, np.float32)}}}
    elif rank == 1 and refusal == "another dtype":
        into["model"]["b"] = np.full(16, -7, np.float32)
    elif rank == 1 and refusal == "one missing":
        del into["model"]["b"]
    return into


@pytest.mark.parametrize("digests", [True, False], ids=["parts", "whole-shards"])
@pytest.mark.parametrize(
    ("refusal", "named"),
    [
        ("whole nesting", r"1 not in the selected paths: 'optim/state/#0/exp_avg'"),
        ("another dtype", r"1 of another dtype or shape: 'model/b' float32 16 \(the selected paths: float64 16\)"),
        ("one missing", r"1 missing from into: 'model/b'"),
    ],
)
def test_a_partial_restore_refusing_into_writes_nothing_into_the_callers_arrays(tmp_path, refusal, named, digests):
    import json

    from tiered_ckpt.format.layout import MANIFEST_NAME

    with CheckpointManager(tmp_path, world_size=2) as manager:
        manager.save(5, [nested(0), nested(1)], blocking=True)
    if not digests:  # a step saved before per-array digests were recorded: its shards are read whole
        path = tmp_path / step_dir_name(5) / MANIFEST_NAME
        document = json.loads(path.read_text())
        for shard in document["shards"]:
            del shard["array_xxh3_64"]
        path.write_text(json.dumps(document))
    into = [into_for(0, refusal), into_for(1, refusal)]
    with CheckpointManager(tmp_path, world_size=2) as manager:
        with pytest.raises(
            InvalidStateError, match=r"into\[1\] does not hold the arrays of the selected paths: " + named
        ):
            manager.restore(paths=["model"], into=into)
    for state in into:  # every array of every rank as it was: nothing was filled before the refusal
        for part in state.values():
            for name, array in part.items():
                if isinstance(array, dict):
                    array = array[0]["exp_avg"]
                assert (array == -7).all(), name
