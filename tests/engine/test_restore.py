"""Restoring a step (tiered_ckpt.engine.restore): what a restore says (logs, its result's repr, its errors)."""

import logging
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from support.processes import launch_ranks
from support.states import flip_byte
from support.stores import save_hashed_and_compressed
from tiered_ckpt import CheckpointManager, InvalidStateError, ManifestError, RemoteOptions
from tiered_ckpt.format.layout import AGREEMENT_NAME, MANIFEST_NAME, shard_name, step_dir_name
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.backends.wrappers import Counting
from tiered_ckpt.tiers.remote.tier import RemoteTier


def many_arrays(world_size: int = 4, count: int = 300) -> list[dict[str, np.ndarray]]:
    """Per rank, ``count`` small arrays (a model of many layers): their repr alone is long."""
    return [
        {f"layer{i}.weight": np.full((8, 8), rank + i, np.float32) for i in range(count)} for rank in range(world_size)
    ]


def records(caplog, level: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelname == level]


def test_the_repr_of_a_restore_names_step_ranks_sources_and_sizes_never_the_arrays(tmp_path):
    states = many_arrays()
    with CheckpointManager(tmp_path, world_size=4) as manager:
        manager.save(7, states, blocking=True)
        restored = manager.restore()
    nbytes = 4 * 300 * 8 * 8 * 4
    shown = repr(restored)
    assert str(restored) == shown and len(shown) < 160, shown
    assert shown == (
        f"RestoreResult(step=7, ranks=0-3, sources={{local: 0-3}}, arrays=1200, nbytes={nbytes}, "
        f"bytes_read={restored.manifest.total_bytes})"
    )
    assert restored.bytes_read > nbytes and restored.seconds >= 0


def test_an_into_that_does_not_match_names_the_difference_not_both_lists(tmp_path):
    states = many_arrays(world_size=1, count=500)
    into = {name: np.zeros_like(array) for name, array in states[0].items()}
    del into["layer7.weight"]
    into["layer9.weight"] = np.zeros((8, 9), np.float32)
    into["layer10.weight"] = np.zeros((8, 8), np.float64)
    into["optimizer.step"] = np.zeros((), np.int64)
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, states, blocking=True)
        with pytest.raises(InvalidStateError) as refused:
            manager.restore(into=[into])
        message = str(refused.value)
        assert len(message) < 500, message
        assert message.endswith(
            "into does not match the shard: 1 missing from into: 'layer7.weight'; 1 not in the shard: "
            "'optimizer.step'; 2 of another dtype or shape: 'layer10.weight' float64 8x8 (the shard: float32 8x8), "
            "'layer9.weight' float32 8x9 (the shard: float32 8x8)"
        )
        assert message.startswith(f"restore of step 1: rank 0 shard {tmp_path / step_dir_name(1) / shard_name(0, 1)}")

        many_missing = {name: array for name, array in into.items() if not name.startswith("layer1")}
        with pytest.raises(InvalidStateError) as refused:
            manager.restore(into=[many_missing])
        message = str(refused.value)
        assert len(message) < 500, message
        # layer1, layer10-19, layer100-199 and layer7, of which the first 5 by name
        first = "'layer1.weight', 'layer10.weight', 'layer100.weight', 'layer101.weight', 'layer102.weight'"
        assert f"112 missing from into: {first}, and 107 more; 1 not in the shard: 'optimizer.step'; 1 of" in message


@pytest.fixture
def uploaded(tmp_path, memory_url):
    """Step 1 of 2 ranks, saved in ``tmp_path/node`` and committed in a memory bucket."""
    url, options = memory_url
    states = [{"w": np.arange(50_000, dtype=np.float32) + rank} for rank in range(2)]
    with CheckpointManager(
        tmp_path / "node", world_size=2, remote=RemoteOptions(url, storage_options=options)
    ) as manager:
        manager.save(1, states, blocking=True)
        manager.wait(uploaded=True)
    return tmp_path / "node", url, options, states


def restore_logged(caplog, directory, url, options):
    with caplog.at_level(logging.INFO, logger="tiered_ckpt"):
        with CheckpointManager(directory, world_size=2, remote=RemoteOptions(url, storage_options=options)) as manager:
            return manager.restore()


def test_a_restore_logs_the_step_each_shards_tier_bytes_and_seconds(uploaded, caplog):
    directory, url, options, states = uploaded
    restored = restore_logged(caplog, directory, url, options)
    assert restored.sources == {0: "local", 1: "local"}
    (line,) = [message for message in records(caplog, "INFO") if message.startswith("restored step")]
    assert re.fullmatch(
        rf"restored step 1 for rank\(s\) 0-1: {restored.manifest.total_bytes} bytes of 2 shard\(s\) read in "
        r"\d+\.\d{3} s; shards by tier: \{local: 0-1\}",
        line,
    ), line
    assert records(caplog, "WARNING") == []


def test_every_shard_repaired_from_the_bucket_is_a_warning_saying_why(uploaded, caplog):
    directory, url, options, states = uploaded
    damaged = directory / step_dir_name(1) / shard_name(1, 2)
    flip_byte(damaged, 1000)
    restored = restore_logged(caplog, directory, url, options)
    assert restored.sources == {0: "local", 1: "remote"}
    assert restored.states[1]["w"].tobytes() == states[1]["w"].tobytes()
    (warning,) = records(caplog, "WARNING")
    assert warning.startswith(f"step 1 rank 1: repaired the local copy from {url}/{step_dir_name(1)}/")
    assert f"the local copy failed: rank 1 shard {damaged}: sha256 is " in warning
    assert any(line.endswith("shards by tier: {local: 0, remote: 1}") for line in records(caplog, "INFO"))


def test_a_node_with_an_empty_disk_reads_from_the_bucket_without_a_warning(uploaded, caplog, tmp_path):
    _directory, url, options, _states = uploaded
    restored = restore_logged(caplog, tmp_path / "new-node", url, options)
    assert restored.sources == {0: "remote", 1: "remote"}
    assert records(caplog, "WARNING") == []  # nothing was damaged: this disk never held the step
    assert sum("not on this node's disk; read from" in line for line in records(caplog, "INFO")) == 2


def test_a_restore_from_the_disk_asks_the_bucket_for_its_manifest_once_beside_the_listing(uploaded, monkeypatch):
    directory, url, options, states = uploaded
    with CheckpointManager(directory, world_size=2, remote=RemoteOptions(url, storage_options=options)) as manager:
        asked, read_done = [], threading.Event()
        for name in ("exists", "head", "read"):
            method = getattr(Counting, name)

            def recorded(self, path, *a, _method=method, _name=name, **kw):
                result = _method(self, path, *a, **kw)
                asked.append((_name, path.rsplit("/", 1)[-1]))
                read_done.set()
                return result

            monkeypatch.setattr(Counting, name, recorded)
        list_names = Counting.list_names

        def listing(self, prefix):
            asked.append(("list", read_done.wait(timeout=60)))  # one after the other, it would wait in vain
            return list_names(self, prefix)

        monkeypatch.setattr(Counting, "list_names", listing)
        restored = manager.restore()
    assert restored.sources == {0: "local", 1: "local"}
    # the disk's step's manifest is read beside the listing, and the disk's copy checked against it
    assert [call for call in asked if call[1] in (MANIFEST_NAME, True, False)] == [
        ("read", MANIFEST_NAME),
        ("list", True),
    ]


def test_a_shard_repaired_after_the_digest_check_is_read_and_named_as_the_bucket_stores_it(
    tmp_path, memory_url, caplog
):
    url, options = memory_url
    states = save_hashed_and_compressed(tmp_path / "node", url, options)
    flip_byte(tmp_path / "node" / step_dir_name(1) / shard_name(1, 2), 1000)
    # a reader's own options say flat and uncompressed: only the bucket's manifest says where the object is
    restored = restore_logged(caplog, tmp_path / "node", url, options)
    assert restored.sources == {0: "local", 1: "remote"}
    assert restored.states[1]["w"].tobytes() == states[1]["w"].tobytes()
    stored = RemoteTier(url, options, layout="hashed").object_name(1, shard_name(1, 2)) + ".zst"
    (warning,) = records(caplog, "WARNING")
    assert warning.startswith(f"step 1 rank 1: repaired the local copy from {url}/{step_dir_name(1)}/{stored};"), (
        warning
    )


def test_a_disks_step_unlike_the_buckets_is_refused(uploaded, tmp_path):
    directory, url, options, states = uploaded
    other = [{"w": np.arange(50_000, dtype=np.float32) * 2 + rank} for rank in range(2)]
    with CheckpointManager(tmp_path / "other", world_size=2) as manager:
        manager.save(1, other, blocking=True)
    kept = {path.name for path in (directory / step_dir_name(1)).iterdir()}
    for path in (tmp_path / "other" / step_dir_name(1)).iterdir():  # the receipt of the bucket's commit stays
        shutil.copy(path, directory / step_dir_name(1) / path.name)
    assert kept > {path.name for path in (tmp_path / "other" / step_dir_name(1)).iterdir()}
    with CheckpointManager(directory, world_size=2, remote=RemoteOptions(url, storage_options=options)) as manager:
        with pytest.raises(
            ManifestError, match="the local and remote manifests of step 1 describe different checkpoints"
        ):
            manager.restore()


def test_an_io_error_on_a_local_shard_restores_from_the_bucket_and_refills_it(uploaded, caplog, monkeypatch):
    from test_store import fail_reads_of

    directory, url, options, states = uploaded
    failing = directory / step_dir_name(1) / shard_name(0, 2)
    fail_reads_of(monkeypatch, failing)
    restored = restore_logged(caplog, directory, url, options)
    assert restored.sources == {0: "remote", 1: "local"}
    assert restored.states[0]["w"].tobytes() == states[0]["w"].tobytes()
    (warning,) = records(caplog, "WARNING")
    assert f"rank 0 shard {failing}: read error: Input/output error" in warning
    with CheckpointManager(directory, world_size=2) as manager:  # the refilled copy reads, without the bucket
        assert manager.restore().sources == {0: "local", 1: "local"}


# --- one process per rank: a world size the disks cannot serve without a bucket (real rank processes) ---

RANK_WORKER = Path(__file__).resolve().parents[1] / "support" / "rank_worker.py"
FSDP_WORKER = Path(__file__).resolve().parents[1] / "support" / "fsdp_worker.py"


def run_ranks(root: Path, world_size: int, actions: list[dict], remote=None) -> dict[int, dict]:
    return launch_ranks(RANK_WORKER, root, world_size, {"actions": actions, "timeout_seconds": 60}, remote=remote)


@pytest.fixture(scope="module")
def two_rank_disks(tmp_path_factory) -> Path:
    """Steps 1 and 2 of a 2-rank job without a bucket, each rank on a disk of its own (``nodes/rank-<r>``)."""
    root = tmp_path_factory.mktemp("two-ranks")
    saved = run_ranks(root, 2, [{"do": "save", "step": 1}, {"do": "save", "step": 2}, {"do": "wait"}])
    assert all("error" not in result for result in saved.values()), saved
    return root


@pytest.mark.slow
def test_ranks_restoring_from_their_disks_leave_the_buckets_manifest_to_the_leader(tmp_path, file_url):
    saved = run_ranks(tmp_path, 2, [{"do": "save", "step": 1}, {"do": "wait"}], remote=file_url)
    assert all("error" not in result for result in saved.values()), saved
    results = run_ranks(tmp_path, 2, [{"do": "restore", "count_manifest_reads": True}], remote=file_url)
    assert [results[rank]["restored"]["sources"] for rank in (0, 1)] == [{"0": "local"}, {"1": "local"}], results
    # the leader's read, beside its listing, checks both disks' copies: not a read a rank
    assert [results[rank]["manifest_reads"] for rank in (0, 1)] == [[1], []]


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [False, True])
def test_growing_the_world_size_without_a_bucket_says_the_step_exists_and_what_restores_it(
    two_rank_disks, tmp_path, reshard
):
    shutil.copytree(two_rank_disks / "nodes", tmp_path / "nodes")
    results = run_ranks(tmp_path, 3, [{"do": "restore", "reshard": reshard}])
    expected = "IncompleteCheckpointError" if reshard else "WorldSizeMismatchError"
    for result in results.values():
        kind, message = result["error"]
        assert kind == expected, result
        assert "no committed checkpoint" not in message
        assert (
            "step 2, saved by 2 ranks, is committed on the disks of ranks 0-1 only and no bucket is configured "
            "(remote.url): rank 2 of this job's 3 holds no copy, and a rank can read the shards on other nodes' "
            "disks only through a bucket; to restore it on 3 ranks, give the job a bucket holding step 2 (remote.url)"
        ) in message, message
        assert message.endswith("(remote.url)" if reshard else "and restore with reshard=True (--reshard)"), message
    assert sorted(path.name for path in (tmp_path / "nodes").iterdir()) == ["rank-0", "rank-1"]  # no empty rank-2
    for rank in range(2):  # nothing the ranks held was touched
        assert sorted(path.name for path in (tmp_path / "nodes" / f"rank-{rank}").iterdir()) == [
            step_dir_name(1),
            step_dir_name(2),
        ]


@pytest.mark.slow
@pytest.mark.parametrize("saved_by", ["this-version", "0.2"])
def test_a_replaced_disk_without_a_bucket_says_the_step_exists_and_where(two_rank_disks, tmp_path, saved_by):
    shutil.copytree(two_rank_disks / "nodes" / "rank-0", tmp_path / "nodes" / "rank-0")  # rank 1's disk is new
    if saved_by == "0.2":  # no record of the commit's agreement: it cannot be told from a save cut short
        for record in (tmp_path / "nodes" / "rank-0").glob(f"*/{AGREEMENT_NAME}"):
            record.unlink()
    for result in run_ranks(tmp_path, 2, [{"do": "restore_if_any"}]).values():
        kind, message = result["error"]  # not None: a step exists, and starting fresh would lose it
        assert kind == "IncompleteCheckpointError", result
        assert (
            "step 2, saved by 2 ranks, is committed on the disks of rank 0 only and no bucket is configured "
            "(remote.url): rank 1 of this job's 2 holds no copy"
        ) in message
        cause = (
            "(every rank committed it: a node's disk was replaced)"
            if saved_by == "this-version"
            else "(a save cut short between ranks' commits, or a node's disk replaced)"
        )
        assert message.endswith(cause), message
    assert not (tmp_path / "nodes" / "rank-1").exists()
    assert LocalTier(tmp_path / "nodes" / "rank-0").steps() == [1, 2]  # nothing deleted


@pytest.mark.slow
def test_steps_saved_before_commit_agreements_were_recorded_still_restore(two_rank_disks, tmp_path):
    shutil.copytree(two_rank_disks / "nodes", tmp_path / "nodes")
    for record in (tmp_path / "nodes").glob(f"*/*/{AGREEMENT_NAME}"):
        record.unlink()  # as 0.2 wrote them
    for rank, result in run_ranks(tmp_path, 2, [{"do": "restore"}]).items():
        assert result["restored"]["step"] == 2, result
        assert LocalTier(tmp_path / "nodes" / f"rank-{rank}").steps() == [1, 2]


@pytest.mark.slow
def test_a_state_of_dtensors_resharded_without_a_bucket_says_it_needs_one_not_file_is_missing(tmp_path):
    saved = launch_ranks(FSDP_WORKER, tmp_path, 3, {"do": "save"})
    assert all("error" not in result for result in saved.values()), saved
    shutil.rmtree(tmp_path / "nodes" / "rank-2")  # the job resumes on the first two nodes
    for rank, result in launch_ranks(FSDP_WORKER, tmp_path, 2, {"do": "restore"}).items():
        kind, message = result["error"]
        assert kind == "IncompleteCheckpointError" and "file is missing" not in message, result
        absent = re.search(r"step 3 was saved by 3 ranks; the shards of ranks \[([\d, ]+)\] are not on this", message)
        assert absent and str(rank) not in absent.group(1).split(", "), message  # another node's shards
        assert "needs a bucket (remote.url) holding it" in message


# --- one process per rank: a save cut short between the ranks' commits (real rank processes) ---


@pytest.mark.slow
def test_a_job_killed_during_its_first_save_relaunches_fresh_and_saves_that_step_again(tmp_path, capfd):
    actions = [{"do": "kill", "rank": 1, "at": "before-commit"}, {"do": "save", "step": 1}, {"do": "wait"}]
    config = {"actions": actions, "timeout_seconds": 60}
    survivor = launch_ranks(RANK_WORKER, tmp_path, 2, config, killed=1)[0]
    assert survivor["error"][0] == "SaveError", survivor
    # rank 0 committed step 1 on its own disk; rank 1 never did
    assert LocalTier(tmp_path / "nodes" / "rank-0").steps() == [1]
    assert LocalTier(tmp_path / "nodes" / "rank-0").agreement(1) is False

    capfd.readouterr()
    relaunched = run_ranks(tmp_path, 2, [{"do": "restore_if_any"}, {"do": "save", "step": 1}, {"do": "wait"}])
    logged = capfd.readouterr().err  # the rank processes' warnings
    assert (
        "step 1 is committed on the disks of rank 0 only, and no rank recorded that every rank committed it "
        "(a save cut short before every rank committed)"
    ) in logged, logged
    assert f"deleting step 1 from {tmp_path / 'nodes' / 'rank-0'}: the save was cut short" in logged
    for rank, result in relaunched.items():
        assert "error" not in result, result
        assert result["restored_if_any"] is None  # nothing was ever committed on every rank
        assert LocalTier(tmp_path / "nodes" / f"rank-{rank}").agreement(1) is True  # the new save of step 1
    again = run_ranks(tmp_path, 2, [{"do": "restore"}])
    for result in again.values():
        assert result["restored"]["step"] == 1, result


def test_a_failed_check_of_the_caller_is_raised_by_restore_and_locate_inside_their_first_collective(tmp_path):
    from tiered_ckpt import UsageError
    from tiered_ckpt.dist.coordination import Attempt, SingleProcessCoordinator
    from tiered_ckpt.engine.restore import Restorer
    from tiered_ckpt.tiers.store import TieredStore

    with CheckpointManager(tmp_path, world_size=2) as manager:
        manager.save(1, many_arrays(2, 3), blocking=True)
    tier = LocalTier(tmp_path)
    restorer = Restorer(TieredStore([tier]), SingleProcessCoordinator(2), 2)
    refused = Attempt(error=UsageError("the caller's check failed"))
    arguments = {"world_size": 2, "reshard": False, "verify": "full", "into": None, "missing_ok": False}
    with tier.lock():
        with pytest.raises(UsageError, match="^the caller's check failed$"):
            restorer.restore(None, **arguments, checked=refused)
        with pytest.raises(UsageError, match="^the caller's check failed$"):
            restorer.locate(None, checked=refused)
        assert restorer.restore(None, **arguments, checked=Attempt.run(lambda: None)).step == 1
        assert restorer.locate(None).step == 1


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [False, True])
def test_shrinking_the_world_size_without_a_bucket_says_what_restores_it_not_file_is_missing(
    two_rank_disks, tmp_path, reshard
):
    """The job of two nodes resumes on node 0 alone: one process, its disk holding rank 0's shards only."""
    shutil.copytree(two_rank_disks / "nodes" / "rank-0", tmp_path / "nodes" / "rank-0")
    (result,) = run_ranks(tmp_path, 1, [{"do": "restore", "reshard": reshard}]).values()
    kind, message = result["error"]
    assert kind == ("IncompleteCheckpointError" if reshard else "WorldSizeMismatchError"), result
    assert "file is missing" not in message
    assert (
        "step 2 was saved by 2 ranks; the shards of ranks [1] are not on this node's disk and no remote tier holds "
        "the step; reading another node's shards (to reshard, or after ranks moved between nodes) needs a bucket "
        "(remote.url) holding it"
    ) in message, message
    if not reshard:  # resharding is not all it takes: say so, as the growing job's error does
        assert message.endswith(
            "to restore it on 1 rank, give the job a bucket holding step 2 (remote.url) and restore with "
            "reshard=True (--reshard)"
        ), message
    assert LocalTier(tmp_path / "nodes" / "rank-0").steps() == [1, 2]  # nothing deleted


def test_a_damaged_shard_is_repaired_from_the_bucket_when_its_listing_failed_once(tmp_path, faulty_s3):
    """A restore whose one-try listing of the bucket fails takes the step from the disks, and
    still asks the bucket for a shard that fails there (a blip is no reason to lose a copy)."""
    proxy, url, options = faulty_s3
    proxy.failure_rate = 0.0
    remote = RemoteOptions(url, storage_options=options)
    states = [{"w": np.arange(4096, dtype=np.float32) + rank} for rank in range(2)]
    with CheckpointManager(tmp_path / "node", world_size=2, remote=remote) as manager:
        manager.save(1, states)
        manager.wait(uploaded=True)
    flip_byte(tmp_path / "node" / step_dir_name(1) / shard_name(1, 2), 1000)
    with CheckpointManager(tmp_path / "node", world_size=2, remote=remote) as manager:
        manager.wait()
        proxy.fail_next = 1  # the restore's listing, tried once: the bucket looks down
        restored = manager.restore()
        assert proxy.fail_next == 0 and restored.step == 1
        assert restored.sources == {0: "local", 1: "remote"}
        assert restored.states[1]["w"].tobytes() == states[1]["w"].tobytes()
        assert manager.restore(1).sources == {0: "local", 1: "local"}  # the repaired copy
