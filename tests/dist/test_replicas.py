"""Replicated arrays of a state of chunks: written once, put back on every rank (tiered_ckpt.dist.replicas)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from support.processes import launch_ranks
from support.states import flip_byte
from tiered_ckpt import (
    CheckpointManager,
    ChecksumMismatchError,
    InvalidStateError,
    ManifestError,
    RemoteOptions,
    ReshardError,
    ShardManifest,
    load_sharded,
    save_sharded,
)
from tiered_ckpt.dist.replicas import Offer, assign, offer, share
from tiered_ckpt.format.layout import MANIFEST_NAME, step_dir_name
from tiered_ckpt.format.state import ChunkOf, flatten

WORKER = Path(__file__).resolve().parents[1] / "support" / "rank_worker.py"


def chunked_states(world_size: int = 3) -> list[dict]:
    """Per rank: a row block of one 2-D tensor, a table every rank holds alike, a value of its own."""
    whole = np.arange(world_size * 4 * 5, dtype=np.float32).reshape(world_size * 4, 5)
    return [
        {
            "weight": ChunkOf(whole[4 * rank : 4 * rank + 4], whole.shape, (4 * rank, 0)),
            "table": np.linspace(0, 1, 64, dtype=np.float64),
            "seed": np.array([rank], dtype=np.int64),
            "epoch": 7,
        }
        for rank in range(world_size)
    ]


def records(directory) -> dict[int, dict]:
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    return {shard["rank"]: shard for shard in manifest["shards"]}


def test_only_plain_arrays_of_a_state_of_chunks_are_offered_and_equal_bytes_fingerprint_alike():
    flat = [flatten(state) for state in chunked_states()]
    assert flat[0].replicated == {"table", "seed"}
    assert flatten({"a": np.zeros(3)}).replicated == frozenset()  # no chunks: nothing is replicated
    offers = offer(flat, [0, 1, 2])
    prints = {(rank, name): fingerprint for rank, name, fingerprint, _size in offers.arrays}
    assert prints[(0, "table")] == prints[(2, "table")] and prints[(0, "seed")] != prints[(1, "seed")]
    assert dict(offers.own_bytes) == {rank: 4 * 5 * 4 for rank in range(3)}


def test_assign_gives_each_group_one_writer_balancing_bytes_and_is_the_same_for_any_order():
    offers = [
        Offer(((0, "big", "x", 1000), (0, "small", "y", 10)), ((0, 0),)),
        Offer(((1, "big", "x", 1000), (1, "small", "y", 10), (1, "own", "z", 5)), ((1, 0),)),
    ]
    left = assign(offers)
    assert left == {1: {"big": 0}, 0: {"small": 1}}  # the big one to rank 0, then the small to the emptier rank 1
    assert assign(reversed(offers)) == left
    assert assign([Offer(((0, "a", "p", 4),), ()), Offer(((1, "a", "q", 4),), ())]) == {}  # bytes differ: both kept


def test_save_sharded_writes_a_replicated_array_once_and_load_sharded_puts_it_back_everywhere(tmp_path):
    states = chunked_states()
    manifest = save_sharded(states, tmp_path / "ckpt", step=5)
    shards = records(tmp_path / "ckpt")
    holders = [rank for rank, shard in shards.items() if any(c["name"] == "table" for c in shard["chunks"])]
    assert len(holders) == 1
    assert all(dict(shards[rank]["replicas"]) == {"table": holders[0]} for rank in range(3) if rank != holders[0])
    assert all(any(c["name"] == "seed" for c in shard["chunks"]) for shard in shards.values())
    assert manifest.shard((holders[0] + 1) % 3).replicas == (("table", holders[0]),)

    loaded = load_sharded(tmp_path / "ckpt", expected_world_size=3)
    for rank, state in enumerate(loaded):
        np.testing.assert_array_equal(state["table"], states[rank]["table"])
        assert state["seed"].tolist() == [rank] and state["epoch"] == 7
        np.testing.assert_array_equal(state["weight"], states[rank]["weight"].data)
    assert loaded[0]["table"] is not loaded[1]["table"]  # every rank its own copy

    into = [{"weight": np.zeros((4, 5), np.float32), "table": np.zeros(64), "seed": np.zeros(1, np.int64)}
            for _ in range(3)]  # fmt: skip
    load_sharded(tmp_path / "ckpt", expected_world_size=3, into=into)
    assert all(np.array_equal(target["table"], states[0]["table"]) for target in into)


def test_a_flipped_byte_in_the_one_copy_fails_the_load_naming_its_holder(tmp_path):
    save_sharded(chunked_states(), tmp_path / "ckpt", step=5)
    shards = records(tmp_path / "ckpt")
    (holder,) = [rank for rank, shard in shards.items() if any(c["name"] == "table" for c in shard["chunks"])]
    flip_byte(tmp_path / "ckpt" / shards[holder]["path"], shards[holder]["size_bytes"] - 200)
    with pytest.raises(ChecksumMismatchError, match=f"rank {holder}"):
        load_sharded(tmp_path / "ckpt", expected_world_size=3)


def test_the_manager_writes_replicas_once_and_restores_them_locally_and_from_the_bucket(tmp_path, memory_url):
    url, options = memory_url
    states = chunked_states()
    with CheckpointManager(tmp_path / "a", world_size=3, remote=RemoteOptions(url, storage_options=options)) as manager:
        manager.save(1, states, blocking=True)
        manager.wait(uploaded=True)
        restored = manager.restore()
    assert [state["table"].tolist() for state in restored.states] == [states[0]["table"].tolist()] * 3
    assert [state["seed"].tolist() for state in restored.states] == [[0], [1], [2]]
    # A node with an empty disk: every shard and the one copy of the table come from the bucket.
    with CheckpointManager(tmp_path / "b", world_size=3, remote=RemoteOptions(url, storage_options=options)) as manager:
        restored = manager.restore()
    assert set(restored.sources.values()) == {"remote"}
    assert all(np.array_equal(state["table"], states[0]["table"]) for state in restored.states)


def data_parallel_states(world_size: int) -> list[dict]:
    """Per rank: a model and optimizer state every rank holds alike (DDP), and a seed of its own."""
    model = {"w": np.arange(600, dtype=np.float32).reshape(20, 30), "b": np.ones(30, np.float32)}
    optim = {"state": {0: {"step": np.array(5.0), "m": np.full((20, 30), 0.5, np.float32)}}, "lr": 0.1}
    return [
        {"model": model, "optim": optim, "seed": np.array([rank]), "seen": np.full(3, rank), "epoch": 2}
        for rank in range(world_size)
    ]


def test_a_data_parallel_save_writes_each_array_once_over_the_ranks_and_restores_on_any_world_size(tmp_path):
    states = data_parallel_states(2)
    with CheckpointManager(tmp_path, world_size=2) as manager:
        manager.save(1, states, blocking=True, replicated=True)
        by_rank = records(tmp_path / step_dir_name(1))
        stored = [{chunk["name"] for chunk in by_rank[rank]["chunks"]} for rank in (0, 1)]
        shared = {"model/w", "model/b", "optim/state/#0/step", "optim/state/#0/m"}
        assert stored[0] & shared and stored[1] & shared and not stored[0] & stored[1] & shared  # once, both wrote
        assert {"seed", "seen"} <= stored[0] & stored[1]  # they differ between the ranks: each keeps its own
        for rank in (0, 1):
            assert {name for name, writer in by_rank[rank]["replicas"]} == shared - stored[rank]
        for world_size in (2, 3, 1):
            restored = manager.restore(world_size=world_size, reshard=True)
            assert len(restored.states) == world_size
            for rank, state in enumerate(restored.states):
                assert np.array_equal(state["model"]["w"], states[0]["model"]["w"])
                assert np.array_equal(state["optim"]["state"][0]["m"], states[0]["optim"]["state"][0]["m"])
                assert state["epoch"] == 2 and state["optim"]["lr"] == 0.1
                assert state["seed"].tolist() == ([rank] if world_size == 2 else [0])  # resharded: rank 0's
                assert state["seen"].tolist() == [rank if world_size == 2 else 0] * 3
        with pytest.raises(InvalidStateError, match=r"replicated must be True or False, got 'yes'"):
            manager.save(2, states, replicated="yes")  # type: ignore[arg-type]
        manager.save(2, states, blocking=True)  # not data parallel: every rank writes all of its state
        assert all(not record.get("replicas") for record in records(tmp_path / step_dir_name(2)).values())


def test_slices_of_a_flat_vector_saved_as_data_parallel_restore_alike_and_refuse_a_reshard(tmp_path):
    flat = np.random.default_rng(1).standard_normal(1003).astype(np.float32)
    slices = [flat[:502].copy(), flat[502:].copy()]
    with CheckpointManager(tmp_path, world_size=2) as manager:
        manager.save(1, [{"params": part, "table": np.arange(6.0)} for part in slices], blocking=True, replicated=True)
        assert [state["params"].tobytes() for state in manager.restore().states] == [part.tobytes() for part in slices]
        with pytest.raises(ReshardError, match=r"'params' is F32 \(502,\) on rank 0 and F32 \(501,\) on rank 1"):
            manager.restore(world_size=3, reshard=True)


def test_chunks_of_one_dtensor_in_another_dtype_or_global_shape_are_refused_before_a_write(tmp_path):
    whole = np.arange(8 * 5, dtype=np.float32).reshape(8, 5)
    states = [{"w": ChunkOf(whole[:4], whole.shape, (0, 0))}, {"w": ChunkOf(np.arange(8), (8,), (0,))}]
    with pytest.raises(InvalidStateError, match=r"rank 1: the DTensor 'w' is int64 \(8,\) here, float32 \(8, 5\)"):
        save_sharded(states, tmp_path / "one-shot", step=1)
    with CheckpointManager(tmp_path / "managed", world_size=2) as manager:
        with pytest.raises(InvalidStateError, match=r"rank 1: the DTensor 'w' is int64"):
            manager.save(1, states)
        assert manager.steps() == []
    assert not (tmp_path / "one-shot").exists()


@pytest.mark.slow
def test_rank_processes_save_data_parallel_once_and_fail_together_when_one_rank_does_not_say_so(tmp_path):
    saves = [
        {"do": "save", "step": 1, "replicated_on_ranks": [0, 1]},
        {"do": "save", "step": 2, "replicated_on_ranks": [1]},
    ]
    results = launch_ranks(WORKER, tmp_path, 2, {"actions": [*saves, {"do": "steps"}], "timeout_seconds": 60})
    for rank in (0, 1):
        kind, message = results[rank]["error"]
        assert kind == "InvalidStateError" and "the ranks called save with different arguments" in message
        assert "'replicated': True" in message
    # Step 1 was data parallel: the table both ranks hold alike is in one shard; their slices stay in each.
    saved = records(tmp_path / "nodes" / "rank-0" / step_dir_name(1))
    assert [name for record in saved.values() for name, _writer in record.get("replicas", [])] == ["schedule"]


@pytest.mark.parametrize(
    "replicas, problem",
    [
        ([["table", 1]], "is not another rank"),  # itself
        ([["table", 7]], "is not another rank"),
        ([["nothing", 0]], "does not store"),
        ([["table", 0], ["table", 0]], "listed twice"),
        ([["seed", 0]], "also stored in this shard"),
        ([["table"]], "expected \\[array name, writer rank\\]"),
        ([["table", "0"]], "expected \\[array name, writer rank\\]"),
        ("table", "expected a list"),
    ],
)
def test_a_manifest_with_bad_replicas_is_refused_naming_the_field(tmp_path, replicas, problem):
    save_sharded(chunked_states(2), tmp_path / "ckpt", step=5)
    document = json.loads((tmp_path / "ckpt" / MANIFEST_NAME).read_text())
    holder = 0 if any(c["name"] == "table" for c in document["shards"][0]["chunks"]) else 1
    assert holder == 0  # the first of two equally loaded ranks
    document["shards"][1]["replicas"] = replicas
    with pytest.raises(ManifestError, match=f"shards\\[.*replicas.*{problem}"):
        ShardManifest.from_dict(document, source="hostile")


class _Wire:
    """A one-rank coordinator of a two-rank job whose broadcasts deliver ``payload`` (a fake that lies on command)."""

    world_size = 2
    local_ranks = (1,)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.calls: list[int] = []

    def broadcast_array(self, array: np.ndarray, source: int) -> None:
        self.calls.append(source)
        array.reshape(-1).view(np.uint8)[:] = np.frombuffer(self.payload, np.uint8)


def test_share_verifies_what_a_holder_sends_against_the_recorded_sha256(tmp_path):
    states = chunked_states(2)
    manifest = save_sharded(states, tmp_path / "ckpt", step=5)
    assert manifest.shard(1).replicas == (("table", 0),)
    good = states[0]["table"].tobytes()
    received = share(_Wire(good), manifest, {})  # type: ignore[arg-type]
    assert received[0]["table"].tobytes() == good
    bad = bytearray(good)
    bad[3] ^= 1
    wire = _Wire(bytes(bad))
    with pytest.raises(ChecksumMismatchError, match="'table' from rank 0"):
        share(wire, manifest, {})  # type: ignore[arg-type]
    assert wire.calls == [0]


def _lie_about_a_holder(directory) -> int:
    """Edit ``directory``'s manifest (3 ranks; rank 0 saved no table, so ranks 1 and 2 share one
    copy) to say rank 0's shard holds the table: a manifest that validates, over shards that
    verify, naming an array the holder's shard does not hold. Returns the rank misled."""
    document = json.loads((directory / MANIFEST_NAME).read_text())
    (holder,) = [shard["rank"] for shard in document["shards"] if any(c["name"] == "table" for c in shard["chunks"])]
    misled = 3 - holder  # of ranks 1 and 2, the one that left the table out
    table = next(c for c in document["shards"][holder]["chunks"] if c["name"] == "table")
    document["shards"][0]["chunks"].append(table)
    document["shards"][misled]["replicas"] = [["table", 0]]
    ShardManifest.from_dict(document)  # it validates
    (directory / MANIFEST_NAME).write_text(json.dumps(document))
    return misled


def test_a_manifest_naming_a_replica_its_holders_shard_does_not_hold_is_a_manifest_error(tmp_path):
    states = chunked_states(3)
    del states[0]["table"]
    save_sharded(states, tmp_path / "ckpt", step=5)
    misled = _lie_about_a_holder(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "rank-00000-of-00003.safetensors"
    problem = f"rank {misled}'s record lists 'table' as written by rank 0, but rank 0's shard {shard} does not store it"
    with pytest.raises(ManifestError) as raised:
        load_sharded(tmp_path / "ckpt", expected_world_size=3)
    assert problem in str(raised.value)

    root = tmp_path / "job"
    root.mkdir()
    (tmp_path / "ckpt").rename(root / step_dir_name(5))
    with CheckpointManager(root, world_size=3) as manager, pytest.raises(ManifestError) as raised:
        manager.restore()
    assert "restore of step 5" in str(raised.value)
    assert problem.replace(str(tmp_path / "ckpt"), str(root / step_dir_name(5))) in str(raised.value)


def test_a_manifest_leaving_out_an_array_the_ranks_own_shard_holds_is_a_manifest_error(tmp_path):
    save_sharded(chunked_states(3), tmp_path / "ckpt", step=5)
    document = json.loads((tmp_path / "ckpt" / MANIFEST_NAME).read_text())
    # rank 1's record says its seed is rank 0's (whose seed differs): refused, not rank 0's value
    document["shards"][1]["chunks"] = [c for c in document["shards"][1]["chunks"] if c["name"] != "seed"]
    document["shards"][1]["replicas"].append(["seed", 0])
    (tmp_path / "ckpt" / MANIFEST_NAME).write_text(json.dumps(document))
    problem = "rank 1's record lists 'seed' as written by rank 0, but rank 1's shard .*rank-00001.* stores it itself"
    with pytest.raises(ManifestError, match=problem):
        load_sharded(tmp_path / "ckpt", expected_world_size=3)
