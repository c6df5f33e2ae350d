"""The peer tier with real rank processes: 4 ranks as 2 "nodes" of 2, each node its own disks and memory.

The nodes are named explicitly (``peer.nodes``), each with a memory folder of its own, so
losing a node is deleting its ranks' directories and its memory folder between launches.
"""

import shutil
from pathlib import Path

import pytest

from support.processes import launch_ranks
from support.stores import FaultInjectingProxy, new_s3_bucket, s3_storage_options
from tiered_ckpt.engine.staging import PIECE_BYTES as SLOT
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.peer.copies import PIECE_BYTES

WORKER = Path(__file__).resolve().parents[2] / "support" / "peer_worker.py"
NODES = ["a", "a", "b", "b"]


def expected_digests(step: int, world_size: int, rank: int) -> dict:
    from support import rank_worker

    return rank_worker.digests(rank_worker.rank_state(step, world_size, rank))


def run_job(root: Path, actions: list[dict], remote=None, killed: int | None = None, nodes=NODES, **options) -> dict:
    """Launch a rank per item of ``nodes`` over ``root`` (disks in ``root/nodes``, memory in ``root/memory-<node>``)."""
    memory = {node: str(root / f"memory-{node}") for node in set(nodes)}
    config = {"actions": actions, "nodes": list(nodes), "memory": memory, "timeout_seconds": 60, **options}
    return launch_ranks(WORKER, root, len(nodes), config, remote=remote, killed=killed)


def lose_node(root: Path, node: str) -> None:
    """Node ``node`` is replaced: its ranks' disks and its memory are gone."""
    for rank, name in enumerate(NODES):
        if name == node:
            shutil.rmtree(root / "nodes" / f"rank-{rank}")
    shutil.rmtree(root / f"memory-{node}")


@pytest.fixture
def counted_bucket(moto_endpoint):
    """(proxy, remote): a fresh bucket reached through a proxy that fails nothing and logs every request."""
    url, _options = new_s3_bucket(moto_endpoint, "tiered-peer")
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=0.0)
    yield proxy, (url, s3_storage_options(proxy.endpoint))
    proxy.close()


def shard_reads(proxy: FaultInjectingProxy) -> list[str]:
    return [path for method, path in proxy.log if method == "GET" and ".safetensors" in path]


@pytest.mark.slow
def test_a_lost_node_restores_byte_for_byte_from_its_partners_without_reading_the_bucket(tmp_path, counted_bucket):
    proxy, remote = counted_bucket
    actions = [{"do": "save", "step": 1}, {"do": "save", "step": 2}, {"do": "wait"}, {"do": "report"}]
    saved = run_job(tmp_path, actions, remote)
    for rank, result in saved.items():
        assert result["peer_errors"] == [None, None], result
        assert (result["lag"]["newest_peer"], result["lag"]["peer_error"], result["lag"]["peer_off"]) == (2, None, None)
        ward = (rank + 2) % 4  # rank r holds the shards of the rank in its place on the other node
        held = {rank_: status for step, tier, rank_, status in result["verify"] if tier == "peer" and step == 2}
        assert held == {r: "ok" if r == ward else "elsewhere" for r in range(4)}
    lose_node(tmp_path, "a")
    proxy.log.clear()

    restored = run_job(tmp_path, [{"do": "restore"}, {"do": "wait"}], remote)
    for rank, result in restored.items():
        assert result["restored"]["step"] == 2, result
        assert result["restored"]["digests"] == expected_digests(2, 4, rank)
        assert result["restored"]["sources"] == {str(rank): "peer" if NODES[rank] == "a" else "local"}
        assert result["refill_error"] is None
    assert shard_reads(proxy) == []  # not one shard was read from the bucket
    for rank in (0, 1):  # the replaced node's disks were refilled from the partners, after restore() returned
        disk = LocalTier(tmp_path / "nodes" / f"rank-{rank}")
        assert disk.steps() == [2]
        assert disk.held_ranks(2, disk.manifest(2)) == [rank]
        assert disk.check_shard(2, disk.manifest(2).shard(rank)) is None  # its bytes match the manifest


@pytest.mark.slow
def test_a_partners_flipped_byte_is_caught_and_the_bucket_is_read_instead(tmp_path, counted_bucket):
    proxy, remote = counted_bucket
    run_job(tmp_path, [{"do": "save", "step": 1}, {"do": "wait"}], remote)
    slots = sorted((tmp_path / "memory-b").rglob("slot-*.bin"))
    assert len(slots) == 2  # node b holds node a's two shards
    for slot in slots:
        data = bytearray(slot.read_bytes())
        data[len(data) // 2] ^= 0x01
        slot.write_bytes(data)
    lose_node(tmp_path, "a")
    proxy.log.clear()

    restored = run_job(tmp_path, [{"do": "restore"}], remote)
    for rank, result in restored.items():
        assert result["restored"]["digests"] == expected_digests(1, 4, rank)
        assert result["restored"]["sources"] == {str(rank): "remote" if NODES[rank] == "a" else "local"}
    assert len(shard_reads(proxy)) == 2  # the two shards of the lost node, each read once


@pytest.mark.slow
def test_a_partner_killed_mid_copy_leaves_the_step_on_disk_and_it_reaches_the_bucket(tmp_path, counted_bucket):
    _proxy, remote = counted_bucket
    actions = [
        {"do": "save", "step": 1},
        {"do": "wait"},
        {"do": "kill_on_copy", "rank": 2, "step": 2},
        {"do": "save", "step": 2},
        {"do": "wait"},
    ]
    cut = run_job(tmp_path, actions, remote, killed=2, timeout_seconds=10, peer_timeout=3)
    assert all("error" in result or "close_error" in result for result in cut.values())  # the job is cut
    for rank in range(4):  # every rank committed step 2 on its disk before the partner copy began
        assert (tmp_path / "nodes" / f"rank-{rank}" / "step-000000000002" / "manifest.json").is_file()

    restored = run_job(tmp_path, [{"do": "wait"}, {"do": "restore"}], remote)
    for rank, result in restored.items():
        assert result["restored"]["step"] == 2
        assert result["restored"]["digests"] == expected_digests(2, 4, rank)
    import fsspec

    url, options = remote
    fs, path = fsspec.core.url_to_fs(url, **options)
    assert fs.exists(f"{path}/step-000000000002/manifest.json")  # the restarted job uploaded it


@pytest.mark.slow
def test_the_memory_held_for_partners_stays_flat_over_100_saves(tmp_path):
    results = run_job(tmp_path, [{"do": "saves", "count": 100}], keep_last=1)
    for result in results.values():
        assert result["peer_error"] is None
        held = result["held"]
        assert len(held) == 100
        # from the second save on, the same bytes and files after every save: the step held and
        # the room for the next one arriving, reused (the first save needed one step's room only)
        assert len(set(map(tuple, held[1:]))) == 1, held[:3]
        assert held[1][0] == 2 * held[0][0] > 0


CADENCE = {"local_every": 4, "peer_every": 2, "max_bytes": 5000}  # room for two steps' shards of one rank


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 256], ids=["staged", "past-the-host-memory-budget"])
def test_steps_between_disk_saves_live_in_the_partners_memory_and_a_restart_restores_the_newest(tmp_path, budget):
    # with a budget of 256 bytes, every save writes most of each state straight from the caller's memory
    saved = run_job(tmp_path, [{"do": "train", "steps": 6}], host_memory_bytes=budget, **CADENCE)
    for result in saved.values():
        assert result["saved"] == [2, 4, 6]  # 1, 3 and 5 go to no tier; 2 and 6 to the partners only
        assert result["local_steps"] == [4]
    restored = run_job(tmp_path, [{"do": "restore"}], **CADENCE)  # every process restarted, no node lost
    for rank, result in restored.items():
        assert result["restored"]["step"] == 6
        assert result["restored"]["sources"] == {str(rank): "peer"}
        assert result["restored"]["digests"] == expected_digests(6, 4, rank)


def test_a_lost_node_falls_back_to_the_newest_step_on_disk_its_partners_still_hold(tmp_path):
    run_job(tmp_path, [{"do": "train", "steps": 6}], **CADENCE)
    lose_node(tmp_path, "a")  # node b's shards of step 6 were in node a's memory only
    restored = run_job(tmp_path, [{"do": "restore"}], **CADENCE)
    for rank, result in restored.items():
        assert result["restored"]["step"] == 4
        assert result["restored"]["sources"] == {str(rank): "peer" if NODES[rank] == "a" else "local"}
        assert result["restored"]["digests"] == expected_digests(4, 4, rank)


@pytest.mark.slow
def test_a_partner_that_hangs_during_a_restore_costs_its_timeout_and_the_bucket_serves_instead(
    tmp_path, counted_bucket
):
    proxy, remote = counted_bucket
    run_job(tmp_path, [{"do": "save", "step": 1}, {"do": "wait"}], remote)
    lose_node(tmp_path, "a")
    proxy.log.clear()
    actions = [{"do": "hang_on_serve", "rank": 2, "seconds": 6}, {"do": "restore"}]
    restored = run_job(tmp_path, actions, remote, peer_timeout=2)
    for rank, result in restored.items():
        assert result["restored"]["digests"] == expected_digests(1, 4, rank)
    sources = {rank: result["restored"]["sources"][str(rank)] for rank, result in restored.items()}
    assert sources == {0: "remote", 1: "peer", 2: "local", 3: "local"}  # rank 2 held rank 0's copy
    assert len(shard_reads(proxy)) == 1


@pytest.mark.slow
def test_on_one_node_the_tier_protects_nothing_and_stays_off(tmp_path):
    results = run_job(tmp_path, [{"do": "report"}], nodes=["a", "a"])
    assert [result["peer_on"] for result in results.values()] == [False, False]


@pytest.mark.slow
def test_a_budget_larger_than_the_memory_file_system_is_refused_on_every_rank(tmp_path):
    results = run_job(tmp_path, [{"do": "report"}], nodes=["a", "b"], max_bytes=1 << 62)
    for result in results.values():
        kind, message = result["error"]
        assert kind == "ConfigError" and "peer.max_bytes is 4611686018427387904 bytes, more than the" in message
        assert "peer.memory_dir" in message


@pytest.mark.slow
def test_a_copy_changed_on_its_way_is_not_kept_and_the_save_goes_on(tmp_path, counted_bucket):
    _proxy, remote = counted_bucket
    actions = [
        {"do": "corrupt_copy", "rank": 0},
        {"do": "save", "step": 1},
        {"do": "uncorrupt_copy"},
        {"do": "save", "step": 2},
        {"do": "wait"},
        {"do": "report"},
    ]
    results = run_job(tmp_path, actions, remote)
    for result in results.values():
        assert "error" not in result and "close_error" not in result, result
        first, second = result["peer_errors"]  # the last failure (time, message) after each save
        assert "step 1" in first[1] and "did not match their sha256; not kept" in first[1]  # seen by every rank
        assert second == first  # step 2's copy succeeded: the last failure is still step 1's
        assert result["lag"]["newest_peer"] == 2 and result["lag"]["newest_remote"] == 2
        peer_steps = {step for step, tier, _rank, status in result["verify"] if tier == "peer"}
        assert peer_steps == {2}  # step 1 is on disk and in the bucket, not in the partners' memory


@pytest.mark.slow
def test_a_partner_that_hangs_during_a_copy_is_given_up_by_every_rank_and_saves_go_on(tmp_path):
    actions = [
        {"do": "hang_on_copy", "rank": 2, "seconds": 6},
        {"do": "save", "step": 1},  # kept in memory only: its copy fails, the partner is given up
        {"do": "save", "step": 2},  # on disk; no copy tried
        {"do": "save", "step": 3},  # kept in memory only, by a tier given up: in no tier, at once
        {"do": "report"},
    ]
    results = run_job(tmp_path, actions, peer_timeout=2, local_every=2)
    for result in results.values():
        assert "error" not in result and "close_error" not in result, result
        assert result["committed"] == [False, True, False]
        first, second, third = result["peer_errors"]
        assert "step 1" in first[1] and second == third == first  # steps 2 and 3 were not even tried
        assert "copy to the peer tier of step 1 failed" in result["lag"]["peer_off"], result["lag"]  # off for good
        assert result["lag"]["newest_local"] == 2 and result["lag"]["newest_peer"] is None  # step 1 was not kept


@pytest.mark.slow
def test_a_holder_of_several_ranks_keeps_each_of_their_copies(tmp_path):
    results = run_job(tmp_path, [{"do": "save", "step": 1}, {"do": "save", "step": 2}, {"do": "report"}], nodes="aab")
    for result in results.values():
        assert result["peer_errors"] == [None, None], result
    held = {r: status for step, tier, r, status in results[2]["verify"] if tier == "peer" and step == 2}
    assert held == {0: "ok", 1: "ok", 2: "elsewhere"}  # rank 2, alone on node b, holds node a's two ranks


@pytest.mark.slow
def test_a_rank_that_cannot_read_its_own_shard_fails_only_its_copy_and_no_partner_waits(tmp_path):
    actions = [
        {"do": "unreadable_copy", "rank": 0},
        {"do": "save", "step": 1},
        {"do": "uncorrupt_copy"},
        {"do": "save", "step": 2},
        {"do": "report"},
    ]
    results = run_job(tmp_path, actions, peer_timeout=30)
    for result in results.values():
        assert "error" not in result and "close_error" not in result, result
        assert "could not read its own shard" in result["peer_errors"][0][1]
        assert result["lag"]["peer_off"] is None and result["lag"]["newest_peer"] == 2  # the next copy went on


@pytest.mark.slow
def test_a_fresh_start_on_new_directories_never_restores_copies_of_an_earlier_run(tmp_path):
    run_job(tmp_path, [{"do": "save", "step": 1}, {"do": "save", "step": 2}])
    earlier = sorted(path.name for node in "ab" for path in (tmp_path / f"memory-{node}").iterdir())
    shutil.rmtree(tmp_path / "nodes")  # every rank's directory deleted; the nodes' memory is intact
    results = run_job(tmp_path, [{"do": "restore_if_any"}])
    assert [result["restored_if_any"] for result in results.values()] == [None] * 4
    now = sorted(path.name for node in "ab" for path in (tmp_path / f"memory-{node}").iterdir())
    assert len(now) == 4 and not set(now) & set(earlier)  # the earlier copies are gone, not just ignored


@pytest.mark.slow
def test_a_step_kept_in_memory_only_that_no_partner_keeps_is_not_saved_and_raises_nothing(tmp_path):
    results = run_job(tmp_path, [{"do": "train", "steps": 3}], local_every=2, max_bytes=100)  # no shard fits
    for result in results.values():
        assert "error" not in result and "close_error" not in result, result
        assert result["saved"] == [2] and result["local_steps"] == [2]  # 1 and 3 are in no tier


@pytest.mark.slow
def test_with_the_default_budget_a_lost_node_resumes_the_newest_disk_step_from_its_partners(tmp_path):
    # disk every 2nd step, partners every step, no peer.max_bytes: step 3 is in memory only
    saved = run_job(tmp_path, [{"do": "train", "steps": 3}], local_every=2)
    for result in saved.values():
        assert result["saved"] == [1, 2, 3] and result["local_steps"] == [2]
    lose_node(tmp_path, "a")  # node b's shards of step 3 were in node a's memory only
    restored = run_job(tmp_path, [{"do": "restore"}, {"do": "wait"}], local_every=2)
    for rank, result in restored.items():
        assert "error" not in result, result
        assert result["restored"]["step"] == 2
        assert result["restored"]["sources"] == {str(rank): "peer" if NODES[rank] == "a" else "local"}
        assert result["restored"]["digests"] == expected_digests(2, 4, rank)
        assert result["refill_error"] is None
    for rank in (0, 1):
        disk = LocalTier(tmp_path / "nodes" / f"rank-{rank}")
        assert disk.steps() == [2] and disk.check_shard(2, disk.manifest(2).shard(rank)) is None


@pytest.mark.slow
def test_a_shard_rotten_on_its_own_disk_is_read_from_the_partner_holding_it_without_a_bucket(tmp_path):
    run_job(tmp_path, [{"do": "save", "step": 1}])
    shard = next((tmp_path / "nodes" / "rank-1" / "step-000000000001").glob("rank-*"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # a real byte flipped on rank 1's disk
    shard.write_bytes(data)
    restored = run_job(tmp_path, [{"do": "restore"}, {"do": "wait"}])
    for rank, result in restored.items():
        assert "error" not in result, result
        assert result["restored"]["digests"] == expected_digests(1, 4, rank)
        assert result["restored"]["sources"] == {str(rank): "peer" if rank == 1 else "local"}
        assert result["refill_error"] is None
    disk = LocalTier(tmp_path / "nodes" / "rank-1")
    assert disk.check_shard(1, disk.manifest(1).shard(1)) is None  # repaired from the partner's copy


@pytest.mark.slow
def test_a_step_no_partner_holds_costs_one_line_per_rank_and_no_warning(tmp_path, counted_bucket):
    _proxy, remote = counted_bucket
    run_job(tmp_path, [{"do": "save", "step": 1}, {"do": "wait"}], remote, peer_every=2)  # the partners skip step 1
    lose_node(tmp_path, "a")
    restored = run_job(tmp_path, [{"do": "record_logs"}, {"do": "restore"}], remote, peer_every=2)
    for rank in (0, 1):
        result = restored[rank]
        assert result["restored"]["sources"] == {str(rank): "remote"}
        assert result["restored"]["digests"] == expected_digests(1, 4, rank)
        lines = [(level, text) for level, text in result["logs"] if f"rank {rank}" in text and "peer" in text]
        assert [level for level, _text in result["logs"] if level in ("WARNING", "ERROR")] == [], result["logs"]
        assert len(lines) == 1 and lines[0][0] == "INFO", lines
        assert "not on this node's disk nor in the peer tier; read from s3://" in lines[0][1]


ROLLBACK = {"local_every": 5, "max_bytes": 12000}  # room for five steps' shards of one rank


@pytest.mark.slow
def test_a_save_after_a_rollback_is_refused_while_the_partners_hold_newer_steps_and_nothing_is_lost(tmp_path):
    saved = run_job(tmp_path, [{"do": "train", "steps": 8}], **ROLLBACK)
    for result in saved.values():
        assert result["saved"] == list(range(1, 9)) and result["local_steps"] == [5]  # 6 to 8: in memory only
    actions = [{"do": "restore", "step": 5}, {"do": "save", "step": 6}]
    rolled_back = run_job(tmp_path, actions, **ROLLBACK)
    for rank, result in rolled_back.items():
        assert result["restored"]["step"] == 5 and result["restored"]["digests"] == expected_digests(5, 4, rank)
        kind, message = result["error"]  # as the disk refuses a step not newer than its newest
        assert kind == "CheckpointExistsError", result
        assert "the partners' memory (peer tier): step 6 is not newer than the newest checkpoint, step 8" in message
    restarted = run_job(tmp_path, [{"do": "restore"}], **ROLLBACK)
    for rank, result in restarted.items():  # no branch was started: step 8 is still the newest, intact
        assert result["restored"]["step"] == 8 and result["restored"]["digests"] == expected_digests(8, 4, rank)


@pytest.mark.slow
def test_steps_a_lost_node_left_unrestorable_in_memory_never_refuse_the_next_saves(tmp_path):
    run_job(tmp_path, [{"do": "train", "steps": 6}], **CADENCE)
    lose_node(tmp_path, "a")  # node b's memory keeps its part of step 6, which no restart can restore
    resumed = run_job(tmp_path, [{"do": "restore"}, {"do": "save", "step": 6}], **CADENCE)
    for result in resumed.values():
        assert "error" not in result, result
        assert result["restored"]["step"] == 4 and result["committed"] == [True]  # 6: in the partners' memory
    restarted = run_job(tmp_path, [{"do": "restore"}], **CADENCE)
    for rank, result in restarted.items():
        assert result["restored"]["step"] == 6 and result["restored"]["digests"] == expected_digests(6, 4, rank)


@pytest.mark.slow
def test_a_lost_node_whose_step_no_partner_holds_is_told_a_bucket_or_a_partners_memory_would_serve_it(tmp_path):
    run_job(tmp_path, [{"do": "save", "step": 1}], peer_every=2)  # the partners skip step 1; no bucket
    lose_node(tmp_path, "a")
    restored = run_job(tmp_path, [{"do": "restore"}], peer_every=2)
    for result in restored.values():
        kind, message = result["error"]
        assert kind == "IncompleteCheckpointError", result
        assert "nor do the partners' memories (peer tier) hold the shards the other ranks lack" in message
        assert "only through a bucket or a partner's memory holding them" in message


# --- the copies under the host memory budget (runtime.host_memory_bytes) -----------------------------

PAIR = ["a", "b"]  # two ranks, each its own node: each sends its shard to the other and holds the other's
MIB = 1 << 20


@pytest.mark.slow
@pytest.mark.parametrize("local_every", [2, 1], ids=["kept-in-memory-only", "on-disk"])
def test_a_copy_of_a_state_five_times_the_budget_holds_the_budget_and_restores_bit_for_bit(tmp_path, local_every):
    budget, state = 16 * MIB, 80 * MIB
    actions = [{"do": "save", "step": 0}, {"do": "measured_save", "step": 1, "bytes": state}]  # step 0 warms up
    options = {"host_memory_bytes": budget, "local_every": local_every, "nodes": PAIR}
    saved = run_job(tmp_path, actions, **options)
    for result in saved.values():
        measured = result["measured"]
        assert measured["peer_error"] is None, result
        assert measured["shard_bytes"] > state and measured["shard_bytes"] % PIECE_BYTES  # a last piece cut short
        # Before: the shard serialized whole into memory (kept in memory only) or its file's map
        # resident whole (on disk), and the ward's copy resident whole too: over 2.5 times this.
        assert measured["peak"] <= budget + SLOT, measured
    if local_every == 1:  # node "a" is replaced: rank 0's shard is left only in rank 1's memory
        shutil.rmtree(tmp_path / "nodes" / "rank-0")
        shutil.rmtree(tmp_path / "memory-a")
    restored = run_job(tmp_path, [{"do": "restore"}], **options)
    for rank, result in restored.items():
        assert result["restored"]["step"] == 1
        from_peer = local_every == 2 or rank == 0
        assert result["restored"]["sources"] == {str(rank): "peer" if from_peer else "local"}
        assert result["restored"]["digests"] == saved[rank]["measured"]["digests"]


@pytest.mark.slow
def test_a_copy_in_many_pieces_the_last_one_short_reassembles_bit_for_bit(tmp_path):
    options = {"local_every": 2, "piece_bytes": 4096, "nodes": PAIR}  # step 1 is kept in the partners' memory only
    saved = run_job(tmp_path, [{"do": "measured_save", "step": 1, "bytes": MIB}], **options)
    for result in saved.values():
        assert result["measured"]["peer_error"] is None
        assert result["measured"]["shard_bytes"] // 4096 > 200 and result["measured"]["shard_bytes"] % 4096
    restored = run_job(tmp_path, [{"do": "restore"}], **options)
    for rank, result in restored.items():
        assert result["restored"]["sources"] == {str(rank): "peer"}
        assert result["restored"]["digests"] == saved[rank]["measured"]["digests"]


@pytest.mark.slow
def test_a_lost_disk_restored_from_the_partners_memory_holds_the_budget_and_is_refilled(tmp_path):
    budget, state = 16 * MIB, 80 * MIB
    options = {"host_memory_bytes": budget, "nodes": PAIR}
    saved = run_job(tmp_path, [{"do": "measured_save", "step": 1, "bytes": state}], **options)
    assert all(result["measured"]["peer_error"] is None for result in saved.values()), saved
    shutil.rmtree(tmp_path / "nodes" / "rank-0")  # node "a" lost its disk: rank 0's shard is in rank 1's memory
    restored = run_job(tmp_path, [{"do": "measured_restore", "step": 1, "bytes": state}], **options)
    for rank, result in restored.items():
        measured = result["measured"]
        assert measured["step"] == 1 and measured["refill_error"] is None, result
        assert measured["sources"] == {str(rank): "peer" if rank == 0 else "local"}
        assert measured["digests"] == saved[rank]["measured"]["digests"]
        # Before: the fetched shard received whole into memory and held there for the refill
        # (rank 0: over 80 MiB); now a piece of it, through a map of a file with no name.
        assert measured["peak"] <= budget + SLOT, measured
    disk = LocalTier(tmp_path / "nodes" / "rank-0")
    assert disk.steps() == [1]
    assert disk.check_shard(1, disk.manifest(1).shard(0)) is None
    assert [path.name for path in disk.root.iterdir() if path.name.startswith("tmp")] == []  # no file left behind


@pytest.mark.slow
def test_a_fetched_copy_a_full_disk_has_no_room_for_is_received_into_memory_and_restores(tmp_path):
    run_job(tmp_path, [{"do": "save", "step": 1}], nodes=PAIR)
    shutil.rmtree(tmp_path / "nodes" / "rank-0")
    actions = [{"do": "record_logs"}, {"do": "no_room_on_disk", "rank": 0}, {"do": "restore"}]
    restored = run_job(tmp_path, actions, nodes=PAIR)
    result = restored[0]
    assert result["restored"]["sources"] == {"0": "peer"}, result
    assert result["restored"]["digests"] == expected_digests(1, 2, 0)
    warned = [message for level, message in result["logs"] if level == "WARNING"]
    assert any("received into memory, past runtime.host_memory_bytes: no room for it" in m for m in warned), warned


def lora_digests(step: int, rank: int) -> dict:
    from support import rank_worker

    return rank_worker.digests(rank_worker.lora_state(step, 4, rank))


def own_and_referenced(disk: LocalTier, step: int, rank: int) -> tuple[int, dict[int, int]]:
    """The bytes of ``rank``'s own file of ``step`` on ``disk``, and those of each file it references, by step."""
    record = disk.manifest(step).shard(rank)
    return record.size_bytes, {ref.step: ref.file.size_bytes for ref in record.references}


@pytest.mark.slow
def test_an_incremental_job_copies_only_what_changed_and_a_lost_node_restores_it_from_its_partners(tmp_path):
    lora = {"state": "lora", "keep_last": 1}
    saved = run_job(tmp_path, [{"do": "train", "steps": 4}, {"do": "peer_held"}], **lora)
    for rank, result in saved.items():
        assert "error" not in result, result
        assert result["saved"] == [1, 2, 3, 4]
        disk = LocalTier(tmp_path / "nodes" / f"rank-{rank}")
        assert disk.steps() == [4]  # keep_last=1: step 1 is deleted, its file kept for the steps referencing it
        own, referenced = own_and_referenced(disk, 4, rank)
        assert list(referenced) == [1] and own < referenced[1] / 2  # the frozen base stays in step 1's file
        # the partner holds step 4 and step 1's file it references, no more: the base once
        held = result["peer_held"]
        assert held["steps"] == [4] and held["kept"] == [1], held
    lose_node(tmp_path, "a")  # ranks 0 and 1: their disks and node a's memory (ranks 2 and 3's copies)
    restored = run_job(tmp_path, [{"do": "restore"}, {"do": "wait"}, {"do": "save", "step": 5}], **lora)
    for rank, result in restored.items():
        assert "error" not in result, result
        assert result["restored"]["step"] == 4
        assert result["restored"]["sources"] == {str(rank): "peer" if NODES[rank] == "a" else "local"}
        assert result["restored"]["digests"] == lora_digests(4, rank)
        assert result["refill_error"] is None and result["peer_errors"] == [None]
        # the refilled disk holds step 1's file again: the next save references it, writing the adapter only
        own, referenced = own_and_referenced(LocalTier(tmp_path / "nodes" / f"rank-{rank}"), 5, rank)
        assert list(referenced) == [1] and own < referenced[1] / 2
    lose_node(tmp_path, "b")  # now node b: step 5's and step 1's copies come from node a's new memory
    again = run_job(tmp_path, [{"do": "restore"}], **lora)
    for rank, result in again.items():
        assert "error" not in result, result
        assert result["restored"]["step"] == 5
        assert result["restored"]["sources"] == {str(rank): "peer" if NODES[rank] == "b" else "local"}
        assert result["restored"]["digests"] == lora_digests(5, rank)


@pytest.mark.slow
def test_with_a_bucket_too_an_incremental_step_a_lost_node_lacks_comes_from_the_partners_alone(
    tmp_path, counted_bucket
):
    proxy, remote = counted_bucket
    lora = {"state": "lora", "keep_last": 1}
    saved = run_job(tmp_path, [{"do": "train", "steps": 3}, {"do": "wait"}], remote, **lora)
    for rank, result in saved.items():
        assert "error" not in result, result
        own, referenced = own_and_referenced(LocalTier(tmp_path / "nodes" / f"rank-{rank}"), 3, rank)
        assert list(referenced) == [1] and own < referenced[1] / 2
    lose_node(tmp_path, "a")
    proxy.log.clear()
    restored = run_job(tmp_path, [{"do": "restore"}, {"do": "wait"}], remote, **lora)
    for rank, result in restored.items():
        assert "error" not in result, result
        assert result["restored"]["sources"] == {str(rank): "peer" if NODES[rank] == "a" else "local"}
        assert result["restored"]["digests"] == lora_digests(3, rank)
        assert result["refill_error"] is None
    assert shard_reads(proxy) == []  # step 3's files and step 1's it references: from the partners' memory


@pytest.mark.slow
def test_a_referenced_file_rotten_on_its_own_disk_is_read_from_the_partner_and_repaired_without_a_bucket(tmp_path):
    import hashlib

    lora = {"state": "lora", "keep_last": 1}
    run_job(tmp_path, [{"do": "train", "steps": 3}], **lora)
    disk = LocalTier(tmp_path / "nodes" / "rank-1")
    ref = disk.manifest(3).shard(1).references[0]
    kept = disk.shard_path(ref.step, ref.file)
    assert kept.parent.name.startswith("kept-step-")  # step 1 is deleted; its file kept for step 3
    data = bytearray(kept.read_bytes())
    data[-100] ^= 0x01  # a real byte flipped in an array of the frozen base
    kept.write_bytes(data)
    restored = run_job(tmp_path, [{"do": "restore"}, {"do": "wait"}], **lora)
    for rank, result in restored.items():
        assert "error" not in result, result
        assert result["restored"]["step"] == 3 and result["restored"]["digests"] == lora_digests(3, rank)
        assert result["refill_error"] is None
    repaired = disk.shard_path(ref.step, ref.file)  # from the partner's copy of step 1's file
    assert hashlib.sha256(repaired.read_bytes()).hexdigest() == ref.file.sha256


def test_an_earlier_file_moved_after_its_path_was_taken_is_read_through_its_writer(tmp_path):
    """Retention moves a referenced file to its step's kept directory while a partner copy of a
    later step is being made: the copy reads it where it is now, not "no such file"."""
    import numpy as np

    from tiered_ckpt import save_sharded
    from tiered_ckpt.io.hashing import copy_and_hash
    from tiered_ckpt.tiers.base import ShardSource
    from tiered_ckpt.tiers.peer.tier import _mapped

    record = save_sharded([{"w": np.arange(4096, dtype=np.float32)}], tmp_path / "step", step=1).shard(0)
    taken, moved = tmp_path / "step" / record.path, tmp_path / "kept" / record.path
    moved.parent.mkdir()
    expected = taken.read_bytes()
    taken.rename(moved)

    def write(out):
        with open(moved, "rb") as source:
            return copy_and_hash(source, out)

    with _mapped(ShardSource(path=taken, write=write), record) as array:
        assert not isinstance(array, BaseException) and array.tobytes() == expected
    with _mapped(ShardSource(path=taken), record) as array:
        assert isinstance(array, FileNotFoundError)  # no writer: the copy says there is nothing to send
