import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from support.states import flip_byte
from support.processes import launch_ranks
from support.stores import new_s3_bucket
from tiered_ckpt import (
    CheckpointManager,
    ConfigError,
    Coordinator,
    InvalidStateError,
    ShardManifest,
    SingleProcessCoordinator,
    UploadOptions,
    UsageError,
)
from tiered_ckpt.dist.coordination import Attempt, Done, from_payload, gather, leader_decides, to_payload
from tiered_ckpt.format.layout import HELD_NAME, MANIFEST_NAME, shard_name, step_dir_name
from tiered_ckpt.tiers.remote.tier import RemoteTier


def test_single_process_coordinator_holds_every_rank_and_leads():
    coordinator = SingleProcessCoordinator(4)
    assert isinstance(coordinator, Coordinator)
    assert list(coordinator.local_ranks) == [0, 1, 2, 3]
    assert coordinator.is_leader and coordinator.world_size == 4
    assert coordinator.all_gather({"step": 3}) == [{"step": 3}]
    assert coordinator.broadcast(7) == 7
    coordinator.barrier()


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True])
def test_single_process_coordinator_rejects_a_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size"):
        SingleProcessCoordinator(world_size)


@dataclass(frozen=True)
class Sample:
    step: int
    note: str | None
    pairs: tuple[tuple[str, int], ...]
    done: bool
    seconds: float


samples = st.builds(
    Sample,
    st.integers(),
    st.none() | st.text(),
    st.lists(st.tuples(st.text(), st.integers())).map(tuple),
    st.booleans(),
    st.floats(allow_nan=False),
)


@pytest.mark.slow
@given(samples)
def test_a_typed_payload_round_trips_through_the_json_a_collective_carries(sample):
    assert from_payload(Sample, json.loads(json.dumps(to_payload(sample)))) == sample
    coordinator = SingleProcessCoordinator(3)
    assert gather(coordinator, "sample", Sample, lambda: sample) == [sample]
    assert leader_decides(coordinator, "sample", Sample, lambda: sample) == sample


def test_an_action_returning_another_type_fails_naming_the_collective():
    with pytest.raises(TypeError, match='collective "plan": the action returned dict, not Sample'):
        gather(SingleProcessCoordinator(1), "plan", Sample, lambda: {"step": 1})
    with pytest.raises(TypeError, match='collective "step": the action returned Done, not Sample'):
        leader_decides(SingleProcessCoordinator(1), "step", Sample, Done)


def test_a_failing_action_raises_its_own_error_from_the_collective():
    def refuse() -> Done:
        raise InvalidStateError("no")

    with pytest.raises(InvalidStateError, match="^no$"):
        gather(SingleProcessCoordinator(2), "check", Done, refuse)
    with pytest.raises(InvalidStateError, match="^no$"):
        leader_decides(SingleProcessCoordinator(2), "check", Done, refuse)


def test_an_attempt_keeps_the_result_or_the_error_until_asked():
    assert Attempt.run(lambda: 3).value == 3 and Attempt.run(lambda: 3).done() == Done()
    failed = Attempt.run(lambda: 1 // 0)
    assert isinstance(failed.error, ZeroDivisionError) and failed.result is None
    with pytest.raises(ZeroDivisionError):
        failed.done()
    with pytest.raises(ZeroDivisionError):
        gather(SingleProcessCoordinator(1), "divide", Done, failed.done)


# --- one process per rank under torch.distributed (real processes, gloo) -------------------

WORKER = Path(__file__).resolve().parents[1] / "support" / "rank_worker.py"


def run_ranks(
    root: Path, world_size: int, actions: list[dict], remote=None, killed: int | None = None, **options
) -> dict:
    """Run ``world_size`` rank processes of one job over ``root``'s local directories; return each rank's result.

    ``killed`` is the rank expected to SIGKILL itself (it leaves no result).
    """
    config = {"actions": actions, "timeout_seconds": 60, **options}
    return launch_ranks(WORKER, root, world_size, config, remote=remote, killed=killed)


def expected_digests(step: int, world_size: int, rank: int) -> dict:
    from support import rank_worker

    return rank_worker.digests(rank_worker.rank_state(step, world_size, rank))


def node(root: Path, rank: int) -> Path:
    return root / "nodes" / f"rank-{rank}"


@pytest.fixture(scope="module")
def saved_job(tmp_path_factory, moto_endpoint):
    """A 4-rank job that saved steps 1 and 2 asynchronously, each uploaded to a moto bucket."""
    remote = new_s3_bucket(moto_endpoint, "tiered-dist")
    root = tmp_path_factory.mktemp("job")
    actions = [
        {"do": "collectives"},
        {"do": "restore_if_any"},
        {"do": "save", "step": 1},
        {"do": "save", "step": 2},
        {"do": "wait"},
    ]
    results = run_ranks(root, 4, actions, remote)
    return root, remote, results


def copy_nodes(job_root: Path, tmp_path: Path, ranks) -> Path:
    for rank in ranks:
        shutil.copytree(node(job_root, rank), node(tmp_path, rank))
    return tmp_path


@pytest.mark.slow
def test_torch_coordinator_gathers_broadcasts_and_fails_every_rank_together(saved_job):
    _root, _remote, results = saved_job
    for rank, result in results.items():
        assert result["gathered"] == [{"rank": r} for r in range(4)]
        assert result["broadcast"] == "from rank 0"
        # rank 1 raises its own error; every other rank raises one of its class naming rank 1
        assert result["agree_error"] == [
            "InvalidStateError",
            "rank 1 refuses" if rank == 1 else 'rank 1 (during "probe"): rank 1 refuses',
        ]
        # the leader's failure to decide: its own error there, the label and rank 0 named elsewhere
        assert result["decide_error"] == [
            "InvalidStateError",
            "rank 0 refuses" if rank == 0 else 'rank 0 (during "verdict"): rank 0 refuses',
        ]
        # typed payloads cross the processes as JSON and come back equal, tuples and all
        assert result["typed_equal"] and result["decided_equal"], result


@pytest.mark.slow
def test_a_failing_action_on_one_of_two_processes_makes_both_raise_naming_the_rank_and_label(tmp_path):
    results = run_ranks(tmp_path, 2, [{"do": "collectives"}])
    assert results[1]["agree_error"] == ["InvalidStateError", "rank 1 refuses"]  # its own error
    assert results[0]["agree_error"] == ["InvalidStateError", 'rank 1 (during "probe"): rank 1 refuses']
    assert results[0]["decide_error"] == ["InvalidStateError", "rank 0 refuses"]
    assert results[1]["decide_error"] == ["InvalidStateError", 'rank 0 (during "verdict"): rank 0 refuses']
    assert (results[0]["agree_error_rank"], results[1]["agree_error_rank"]) == (1, None)  # the rank it came from
    # An exception not of the error tree: the failing rank raises its own, the others a RankFailedError.
    assert results[1]["foreign_error"] == ["OSError", "disk on fire", None, None]
    assert results[0]["foreign_error"] == [
        "RankFailedError",
        'rank 1 (during "foreign") failed with OSError: disk on fire',
        1,
        "OSError",
    ]
    assert all(result["typed_equal"] and result["decided_equal"] for result in results.values()), results


@pytest.mark.slow
def test_a_save_takes_three_rounds_of_collectives_and_a_long_payload_one_more(tmp_path):
    actions = [{"do": "count_rounds", "step": 1}, {"do": "count_rounds", "step": 2}, {"do": "long_payloads"}]
    results = run_ranks(tmp_path, 2, actions)
    for result in results.values():
        # the call's check, the shard records, the commit's agreement: one backend round each
        assert result["rounds"] == [3, 3], result
        # 10,000 and 20,000 bytes are over a new channel's 4 KiB; short ones then fit the grown
        # capacity, and 60,000 bytes are over it again
        assert result["long"] == [[True, 2], [True, 1], [True, 2]], result


@pytest.mark.slow
def test_each_rank_writes_only_its_shard_and_the_step_commits_in_both_tiers(saved_job):
    root, remote, results = saved_job
    assert all("error" not in result for result in results.values()), results
    assert all(result["restored_if_any"] is None for result in results.values())  # a fresh start on every rank
    manifests = set()
    for rank in range(4):
        directory = node(root, rank) / step_dir_name(2)
        shards = sorted(path.name for path in directory.glob("*.safetensors"))
        assert shards == [shard_name(rank, 4)]
        assert json.loads((directory / HELD_NAME).read_text()) == {"ranks": [rank]}
        manifests.add((directory / MANIFEST_NAME).read_text())
    assert len(manifests) == 1  # every node committed the same manifest
    manifest = ShardManifest.from_json(manifests.pop())
    assert [record.rank for record in manifest.shards] == [0, 1, 2, 3]
    tier = RemoteTier(*remote)
    assert tier.steps() == [1, 2]
    assert tier.read_manifest(2).manifest.shards == manifest.shards


@pytest.mark.slow
def test_restore_is_byte_equal_on_every_rank_and_only_the_replaced_node_downloads(saved_job, tmp_path):
    job_root, remote, _results = saved_job
    root = copy_nodes(job_root, tmp_path, [0, 1, 3])  # rank 2's node was replaced: empty disk
    results = run_ranks(root, 4, [{"do": "restore"}], remote)
    for rank, result in results.items():
        assert "error" not in result, result
        assert result["restored"]["step"] == 2
        assert result["restored"]["digests"] == expected_digests(2, 4, rank)
        assert result["restored"]["sources"] == {str(rank): "remote" if rank == 2 else "local"}
    refilled = node(root, 2) / step_dir_name(2)  # rank 2's disk is refilled with its own shard
    assert (refilled / MANIFEST_NAME).exists()
    assert json.loads((refilled / HELD_NAME).read_text()) == {"ranks": [2]}


@pytest.mark.slow
def test_a_different_world_size_fails_on_every_rank_unless_resharding_is_asked(saved_job, tmp_path):
    job_root, remote, _results = saved_job
    root = copy_nodes(job_root, tmp_path, [0, 1])
    refused = run_ranks(root, 2, [{"do": "restore"}], remote)
    for result in refused.values():
        assert result["error"][0] == "WorldSizeMismatchError"
        assert "4 ranks" in result["error"][1]
    resharded = run_ranks(root, 2, [{"do": "restore", "reshard": True}], remote)
    for rank, result in resharded.items():
        assert "error" not in result, result
        assert result["restored"]["digests"] == expected_digests(2, 2, rank)
    # new rank 0 holds old ranks 0 and 1: old rank 0's shard is on its disk, old rank 1's in the bucket
    assert resharded[0]["restored"]["sources"] == {"0": "local", "1": "remote"}
    assert resharded[1]["restored"]["sources"] == {"2": "remote", "3": "remote"}
    assert json.loads((node(root, 0) / step_dir_name(2) / HELD_NAME).read_text()) == {"ranks": [0, 1]}


@pytest.mark.slow
def test_resharding_across_nodes_without_a_bucket_says_it_needs_one(saved_job, tmp_path):
    job_root, _remote, _results = saved_job
    root = copy_nodes(job_root, tmp_path, [0, 1])
    for rank, result in run_ranks(root, 2, [{"do": "restore", "reshard": True}]).items():
        assert result["error"][0] == "IncompleteCheckpointError"
        absent = [2, 3] if rank == 1 else [1]  # new rank 0 needs old ranks 0-1, new rank 1 old ranks 2-3
        assert f"the shards of ranks {absent} are not on this node's disk" in result["error"][1]
        assert "needs a bucket" in result["error"][1]


@pytest.mark.slow
def test_the_cli_verifies_a_node_directory_without_counting_other_nodes_shards_as_missing(saved_job, tmp_path):
    job_root, _remote, _results = saved_job
    root = copy_nodes(job_root, tmp_path, [3])
    command = [sys.executable, "-m", "tiered_ckpt", "--local-dir", str(node(root, 3)), "verify", "2"]
    verified = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0, verified.stderr
    assert "step 2 local  rank 1: held by another node" in verified.stdout
    assert "1 shards verified, 0 failed, 3 held by other nodes" in verified.stdout
    listed = subprocess.run([*command[:-2], "--json", "ls"], capture_output=True, text=True, timeout=120)
    assert [row["local_ranks"] for row in json.loads(listed.stdout)] == [[3], [3]]  # steps 1 and 2
    listed = subprocess.run([*command[:-2], "ls"], capture_output=True, text=True, timeout=120)
    assert "1/4" in listed.stdout.splitlines()[-1]
    flip_byte(node(root, 3) / step_dir_name(2) / shard_name(3, 4), 200)
    failed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "0 shards verified, 1 failed, 3 held by other nodes" in failed.stdout


@pytest.mark.slow
@pytest.mark.parametrize("at", ["after-shard", "before-commit"])
def test_sigkill_of_one_rank_during_a_save_leaves_the_previous_step_on_every_rank(tmp_path, s3_url, at):
    first = [{"do": "save", "step": 1}, {"do": "wait"}, {"do": "kill", "rank": 1, "at": at}]
    survivors = run_ranks(tmp_path, 4, [*first, {"do": "save", "step": 2}, {"do": "wait"}], s3_url, killed=1)
    for result in survivors.values():
        assert result["error"][0] == "SaveError", result  # the commit is agreed: it fails with the others
        assert "a collective with the other ranks failed" in result["error"][1]  # CoordinationError, chained
        assert f'(during "{"write" if at == "after-shard" else "commit"}")' in result["error"][1], result
    assert RemoteTier(*s3_url).steps() == [1]
    committed = [(node(tmp_path, rank) / step_dir_name(2) / MANIFEST_NAME).exists() for rank in range(4)]
    # killed before the commit was agreed, no rank commits; killed after, only rank 1 lacks the step
    assert committed == ([False] * 4 if at == "after-shard" else [True, False, True, True])

    relaunched = run_ranks(tmp_path, 4, [{"do": "restore"}, {"do": "save", "step": 2}, {"do": "wait"}], s3_url)
    for rank, result in relaunched.items():
        assert "error" not in result, result
        assert result["restored"]["step"] == 1
        assert result["restored"]["digests"] == expected_digests(1, 4, rank)
    assert RemoteTier(*s3_url).steps() == [1, 2]


@pytest.mark.slow
def test_two_ranks_given_one_directory_both_fail_to_start_naming_the_fix(tmp_path):
    results = run_ranks(tmp_path, 2, [{"do": "save", "step": 1}], shared_dir=True)
    for result in results.values():
        assert result["error"][0] == "DirectoryInUseError"
    # whichever rank lost the race says why and what to do; the other names that rank
    assert any("give each rank a directory of its own (local.dir)" in result["error"][1] for result in results.values())


@pytest.mark.slow
def test_a_coordinator_on_a_process_group_saves_and_restores_only_that_groups_ranks(tmp_path):
    actions = [{"do": "collectives"}, {"do": "save", "step": 1}, {"do": "restore"}]
    results = run_ranks(tmp_path, 3, actions, subgroup=[0, 2])
    assert set(results[1]) == {"rank"}  # not in the group: took no part
    for job_rank, group_rank in [(0, 0), (2, 1)]:
        result = results[job_rank]
        assert result["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert result["restored"]["digests"] == expected_digests(1, 2, group_rank)
    assert sorted(path.name for path in (tmp_path / "nodes").iterdir()) == ["rank-0", "rank-1"]


@pytest.mark.slow
def test_ranks_calling_save_with_different_steps_fail_together(tmp_path):
    results = run_ranks(tmp_path, 2, [{"do": "save", "step": 1, "step_by_rank": {"1": 2}}])
    for result in results.values():
        assert result["error"][0] == "InvalidStateError"
        assert "the ranks called save with different arguments: {0: {'step': 1}, 1: {'step': 2}}" in result["error"][1]


@pytest.mark.slow
def test_an_array_one_rank_cannot_save_fails_the_save_on_every_rank(tmp_path):
    actions = [{"do": "save", "step": 1, "text_on_rank": 1}]
    for rank, result in run_ranks(tmp_path, 2, actions).items():
        assert result["error"][0] == "InvalidStateError"
        named = "rank 1" if rank == 1 else 'rank 1 (during "save")'  # and the collective, elsewhere
        assert result["error"][1].startswith(f'{named}: state["note"] has dtype <U32'), result  # named once
        assert not (node(tmp_path, rank) / step_dir_name(1)).exists()


@pytest.mark.slow
def test_a_failed_upload_is_raised_by_every_rank_at_the_same_call_and_only_once(tmp_path, s3_url):
    url, options = s3_url
    (tmp_path / "a-file").write_bytes(b"")
    missing = f"file://{tmp_path}/a-file/run"  # rank 1's uploads fail: its directory cannot be made
    actions = [{"do": "save", "step": 1}, {"do": "drain_uploads", "rank": 1}, {"do": "save", "step": 2}]
    results = run_ranks(tmp_path, 2, actions, (url, options), url_by_rank={"1": missing})
    for result in results.values():
        assert result["error"][0] == "UploadError" and "step 1" in result["error"][1], result
        assert "close_error" not in result, result  # not raised a second time when it arrives later
    assert RemoteTier(url, options).steps() == []


@pytest.mark.slow
def test_a_missing_bucket_on_one_rank_is_raised_by_every_rank_at_construction(tmp_path, s3_url):
    url, options = s3_url
    missing = url.replace("tiered-test-", "tiered-missing-")
    results = run_ranks(tmp_path, 2, [{"do": "save", "step": 1}], (url, options), url_by_rank={"1": missing})
    for result in results.values():
        assert result["error"][0] == "RemoteError" and "does not exist" in result["error"][1], result
    assert RemoteTier(url, options).list_steps() == ([], [])


class OneOfTwoRanks:
    """Rank 0 of 2, whose partner sends what it sends: for the checks made by a manager's first collective."""

    world_size, local_ranks, is_leader = 2, (0,), True

    def all_gather(self, payload):
        return [payload, payload]


def test_skipping_uploads_when_behind_is_refused_with_one_process_per_rank(tmp_path):
    with pytest.raises(ConfigError, match="^upload.when_behind is 'skip'.*ranks could skip") as caught:
        CheckpointManager(tmp_path, coordinator=OneOfTwoRanks(), upload=UploadOptions(when_behind="skip"))
    assert caught.value.field == "upload.when_behind"
    with pytest.raises(UsageError, match="world_size is 3 but the coordinator has 2"):
        CheckpointManager(tmp_path, world_size=3, coordinator=OneOfTwoRanks())
    with pytest.raises(UsageError, match="world_size is required"):
        CheckpointManager(tmp_path)


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step_with_it_committed_in_the_bucket(tmp_path, s3_url):
    url, options = s3_url
    actions = [{"do": "train", "steps": 50, "signal_rank": 2, "signal_at": 17}]
    results = run_ranks(tmp_path, 3, actions, remote=s3_url)
    assert [results[rank].get("preempted_at") for rank in range(3)] == [17, 17, 17], results
    assert RemoteTier(url, options).steps() == [17]
    for rank in range(3):
        assert (tmp_path / "nodes" / f"rank-{rank}" / step_dir_name(17) / MANIFEST_NAME).is_file()


@pytest.mark.slow
def test_ranks_asking_about_preemption_at_different_steps_fail_together(tmp_path):
    results = run_ranks(tmp_path, 2, [{"do": "ask_preemption", "step": 3, "step_by_rank": {"1": 4}}])
    for rank in range(2):
        assert results[rank]["error"][0] == "UsageError", results
        assert "different steps [3, 4]" in results[rank]["error"][1]


@pytest.mark.slow
def test_ranks_retry_a_failing_bucket_together_and_commit_every_step_once_it_is_back(tmp_path, moto_endpoint, s3_url):
    import threading
    import time

    from support.stores import FaultInjectingProxy, s3_storage_options

    url, options = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=1.0, methods=("PUT",))  # every upload refused: 503
    actions = [{"do": "save", "step": 1}, {"do": "save", "step": 2}, {"do": "wait"}]
    results: dict = {}
    job = threading.Thread(
        target=lambda: results.update(run_ranks(tmp_path, 2, actions, (url, s3_storage_options(proxy.endpoint))))
    )
    job.start()
    try:
        give_up = time.monotonic() + 120  # a guard against a hang, not a timing
        while proxy.injected < 6 and job.is_alive():  # the step's upload tried again, on every rank, together
            assert time.monotonic() < give_up
            time.sleep(0.05)
        proxy.failure_rate = 0.0  # the bucket is back
        job.join(timeout=300)
    finally:
        proxy.close()
    assert not job.is_alive()
    for result in results.values():
        assert "error" not in result and "close_error" not in result, result  # no rank failed for the bucket
    assert RemoteTier(url, options).steps() == [1, 2]


@pytest.mark.slow
def test_two_ranks_save_through_a_bucket_that_never_answers_and_every_step_arrives_once_it_answers(
    tmp_path, moto_endpoint, s3_url
):
    import threading
    import time

    from support.stores import FaultInjectingProxy, s3_storage_options

    url, options = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=0.0)
    signals = tmp_path / "signals"
    signals.mkdir()
    actions = [
        {"do": "save", "step": 1},
        {"do": "wait"},
        {"do": "signal", "path": str(signals / "uploaded")},
        {"do": "await", "path": str(signals / "hung")},
        {"do": "saves", "steps": [2, 3, 4, 5, 6, 7]},  # more than max_pending, while the bucket hangs
        {"do": "await_retrying"},
        {"do": "signal", "path": str(signals / "saved")},
        {"do": "await", "path": str(signals / "answering")},
        {"do": "wait"},
    ]
    upload = {"timeout_seconds": 0.5, "max_tries": 10_000, "max_seconds": 3600, "backoff_seconds": 0.01}
    results: dict = {}
    job = threading.Thread(
        target=lambda: results.update(
            run_ranks(
                tmp_path, 2, actions, (url, s3_storage_options(proxy.endpoint)),
                upload={**upload, "max_backoff_seconds": 0.1}, max_awaiting_upload=10,
            )
        )
    )  # fmt: skip
    job.start()

    def until(*names: str) -> bool:  # a guard against a hang, not a timing
        give_up = time.monotonic() + 120
        while not all((signals / name).exists() for name in names) and job.is_alive():
            if time.monotonic() > give_up:
                return False
            time.sleep(0.05)
        return all((signals / name).exists() for name in names)

    try:
        assert until("uploaded-0", "uploaded-1")
        proxy.stall = ("GET", "PUT", "POST", "HEAD", "DELETE")  # accepted, read, never answered
        (signals / "hung").touch()
        saved = until("saved-0", "saved-1")  # every save returned, and each rank shows its step retrying
    finally:
        proxy.stall = ()  # the bucket answers again
        (signals / "answering").touch()
        job.join(timeout=300)
        proxy.close()
    assert saved, "a save waited for the hung bucket"
    assert not job.is_alive()
    for result in results.values():
        assert "error" not in result and "close_error" not in result, result  # no rank failed for the bucket
        assert result["retrying"][0] == 2 and result["retrying"][1] >= 1
    assert RemoteTier(url, options).steps() == [1, 2, 3, 4, 5, 6, 7]


def test_two_ranks_started_while_the_bucket_is_down_keep_at_most_max_awaiting_upload_steps_queued(
    tmp_path, moto_endpoint, s3_url
):
    import threading
    import time

    from support.stores import FaultInjectingProxy, s3_storage_options

    url, options = s3_url
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=1.0)  # down from the start: set up in the background
    signals = tmp_path / "signals"
    signals.mkdir()
    actions = [
        {"do": "saves", "steps": [1, 2, 3, 4, 5, 6]},  # more than max_awaiting_upload, while the setup retries
        {"do": "await_queued", "at_most": 2, "guard_seconds": 60},
        {"do": "saves", "steps": [7]},
        {"do": "await_queued", "at_most": 2, "guard_seconds": 60},
        {"do": "signal", "path": str(signals / "queued")},
        {"do": "await", "path": str(signals / "answering")},
        {"do": "wait"},
    ]
    upload = {"max_tries": 2, "backoff_seconds": 0.01, "max_backoff_seconds": 0.05, "max_pending": 1}
    results: dict = {}
    job = threading.Thread(
        target=lambda: results.update(
            run_ranks(
                tmp_path, 2, actions, (url, s3_storage_options(proxy.endpoint)), upload=upload, max_awaiting_upload=2
            )
        )
    )
    job.start()
    try:
        give_up = time.monotonic() + 180  # a guard against a hang, not a timing
        while not all((signals / f"queued-{rank}").exists() for rank in range(2)) and job.is_alive():
            assert time.monotonic() < give_up, "the ranks never got through their saves"
            time.sleep(0.05)
    finally:
        proxy.failure_rate = 0.0  # the bucket answers: set up, and the steps still on disk go up
        (signals / "answering").touch()
        job.join(timeout=300)
        proxy.close()
    assert not job.is_alive()
    for result in results.values():
        assert "error" not in result and "close_error" not in result, result  # each queue came down to 2 steps
        assert result["queued"][-1] == 7  # the newest step is never dropped
    assert results[0]["queued"] == results[1]["queued"]  # the ranks dropped the same steps
    for rank in range(2):  # the superseded steps are gone from the disk (keep_last=3)
        on_disk = sorted(int(path.name.rsplit("-", 1)[1]) for path in node(tmp_path, rank).glob("step-*"))
        assert on_disk == [5, 6, 7], on_disk
    assert RemoteTier(url, options).steps()[-1] == 7
