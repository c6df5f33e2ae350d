"""The check of a save call (tiered_ckpt/engine/saving.py), on one process holding every rank."""

from pathlib import Path

import numpy as np
import pytest

from tiered_ckpt import (
    CheckpointExistsError,
    CheckpointManager,
    DirectoryInUseError,
    InvalidStateError,
    SaveError,
    UploadError,
)
from tiered_ckpt.dist.coordination import Attempt, SingleProcessCoordinator
from tiered_ckpt.engine.saving import SaveReport, check_save, not_saved
from tiered_ckpt.format.state import ChunkOf


def states(world_size=2):
    return [
        {"flat": np.arange(6, dtype=np.float32) + rank, "scale": np.ones((2, 2), dtype=np.float32)}
        for rank in range(world_size)
    ]


def check(step, given, newest=None, **keywords):
    keywords.setdefault("sharded_keys", None)
    return check_save(
        SingleProcessCoordinator(len(given)), step, given, checked=Attempt(newest), where="/ckpt", **keywords
    )


def test_a_checked_save_gives_the_flattened_states_and_the_flat_parameter_slices():
    plan = check(5, states())
    assert [sorted(state.arrays) for state in plan.states] == [["flat", "scale"]] * 2
    assert plan.sharded_keys == ("flat",) and plan.numels == (6, 6)  # the 1-D arrays, by the default rule
    with pytest.raises(InvalidStateError, match="rank 0: sharded key 'scale' has shape"):
        check(5, states(), sharded_keys=["scale"])  # a sharded key must be a 1-D slice


def test_a_step_not_newer_than_the_newest_is_refused_naming_the_directory():
    with pytest.raises(CheckpointExistsError, match=r"^/ckpt: step 4 is not newer than the newest checkpoint, step 4$"):
        check(4, states(), newest=4)
    with pytest.raises(CheckpointExistsError, match=r"ask reached_preemption\(step\) before the step's regular save"):
        check(4, states(), newest=4, stop_step=4)  # the stop step saved twice gets the hint
    assert check(5, states(), newest=4, stop_step=4).sharded_keys == ("flat",)


def test_the_callers_own_check_fails_the_save_before_any_state_is_read():
    failed = Attempt(None, DirectoryInUseError("/ckpt was replaced"))
    with pytest.raises(DirectoryInUseError, match="replaced"):
        check_save(SingleProcessCoordinator(1), 1, object(), checked=failed, sharded_keys=None, where="/ckpt")


@pytest.mark.parametrize(
    ("step", "given", "problem"),
    [
        (-1, states(), "step must be an integer"),
        (True, states(), "step must be an integer"),
        (1, states()[:1], "world_size"),
        (1, [{"x": object()}] * 2, "rank 0"),
    ],
)
def test_bad_input_is_an_invalid_state_error(step, given, problem):
    coordinator = SingleProcessCoordinator(2)
    with pytest.raises(InvalidStateError, match=problem):
        check_save(coordinator, step, given, checked=Attempt(None), sharded_keys=None, where="/ckpt")


def test_a_background_error_raised_around_the_check_says_the_step_was_not_saved():
    cause = OSError("disk full")
    error = SaveError("step 2: writing failed", step=2)
    error.__cause__ = cause
    with pytest.raises(SaveError, match=r"^step 2: writing failed \(so step 3 was not saved") as caught:
        with not_saved(3):
            raise error
    assert caught.value.__cause__ is cause
    with pytest.raises(UploadError, match="so step 3 was not saved"), not_saved(3):
        raise UploadError("access denied", step=2, tries=1)
    with pytest.raises(InvalidStateError, match="^bad$"), not_saved(3):  # the check's own errors pass unchanged
        raise InvalidStateError("bad")


def test_the_report_is_a_frozen_payload():
    report = SaveReport('{"step": 1}', None, ((("flat", (6,)),),), True, (100,))
    with pytest.raises(AttributeError):
        report.newest = 3  # type: ignore[misc]


class CountingCoordinator(SingleProcessCoordinator):
    """One process holding every rank, counting its collectives: with a process per rank each is a
    round every process waits for."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.rounds = 0

    def all_gather(self, payload):
        self.rounds += 1
        return super().all_gather(payload)

    def broadcast(self, payload):
        self.rounds += 1
        return super().broadcast(payload)

    def barrier(self) -> None:
        self.rounds += 1


def test_a_save_is_three_collectives_and_one_more_only_when_a_rank_holds_copies_of_arrays(tmp_path):
    whole = np.arange(2 * 4 * 3, dtype=np.float32).reshape(8, 3)
    plain = [{"w": np.full(5, rank, dtype=np.float32)} for rank in range(2)]
    chunked = [{"w": ChunkOf(whole[4 * r : 4 * r + 4], whole.shape, (4 * r, 0)), "table": np.ones(9)} for r in range(2)]
    coordinator = CountingCoordinator(2)
    counted = []
    with CheckpointManager(tmp_path, coordinator=coordinator) as manager:
        for step, states in ((1, plain), (2, chunked), (3, plain)):
            before = coordinator.rounds
            manager.save(step, states, blocking=True)
            counted.append(coordinator.rounds - before)
        manifest = manager.restore(2).manifest
    # the call's check, the shard records, the commit; the exchange of copies only for step 2
    assert counted == [3, 4, 3]
    assert [record.replicas for record in manifest.shards] == [(), (("table", 0),)]  # the copy written once


def test_slices_of_one_flat_vector_in_different_dtypes_are_refused_before_anything_is_written(tmp_path):
    mixed = [{"flat": np.arange(4, dtype=np.float32 if rank != 1 else np.float64)} for rank in range(3)]
    named = r"sharded key 'flat' .* differ in dtype: float32 on ranks 0, 2; float64 on rank 1"
    with CheckpointManager(tmp_path, world_size=3) as manager:
        with pytest.raises(InvalidStateError, match=named):
            manager.save(1, mixed, blocking=True)
        assert manager.steps() == [] and not any(tmp_path.glob("step-*"))
        manager.save(1, [{"flat": np.arange(4, dtype=np.float32)} for _ in range(3)], blocking=True)
        assert manager.steps() == [1]  # the manager goes on
    from tiered_ckpt import save_sharded

    with pytest.raises(InvalidStateError, match=named):  # the one-shot save too
        save_sharded(mixed, tmp_path / "oneshot", 1)
    assert not (tmp_path / "oneshot").exists()


def test_ranks_holding_one_flat_vector_in_different_dtypes_all_refuse_the_save_naming_them(tmp_path):
    from support.processes import launch_ranks
    from tiered_ckpt.format.layout import step_dir_name

    worker = Path(__file__).resolve().parents[1] / "support" / "rank_worker.py"
    config = {"actions": [{"do": "save", "step": 1, "float64_on_rank": 1}], "timeout_seconds": 60}
    for rank, result in launch_ranks(worker, tmp_path, 3, config).items():
        assert result["error"][0] == "InvalidStateError", result
        assert "sharded key 'params'" in result["error"][1], result
        assert "float32 on ranks 0, 2; float64 on rank 1" in result["error"][1], result
        assert not (tmp_path / "nodes" / f"rank-{rank}" / step_dir_name(1)).exists()
