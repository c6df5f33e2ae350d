"""Stale saves (tiered_ckpt.engine.stale): a step whose arrays did not change since the step before
it is said (WARNING) or refused before its commit, by the per-array digests its manifest records."""

import logging

import numpy as np
import pytest

from tiered_ckpt import CheckpointManager, RuntimeOptions, SaveError
from tiered_ckpt.format import manifest as manifest_module
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.format.state import ChunkOf


def state(step: int, *, optim_step: int | None = None, model_step: int | None = None) -> dict:
    """A state as training leaves it at ``step``; its optimizer's or model's arrays as at another step if given."""
    rng = np.random.default_rng(0)
    model = {"w": rng.random((32, 8)) + (model_step or step), "frozen": np.arange(16.0)}
    optim = {name: rng.random(8) * (optim_step or step) for name in ("m", "v")}
    return {"model": model, "optim": optim, "lr": 0.1}


def stale_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "may be stale" in r.getMessage()]


def test_a_save_of_the_same_arrays_is_said_stale_naming_both_steps(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "tiered_ckpt")
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(10, state(1), blocking=True)
        manager.save(20, state(2), blocking=True)  # every array but the frozen one changed
        assert stale_warnings(caplog) == []
        manager.save(30, state(2), blocking=True)
        manager.save(40, {**state(2), "lr": 0.0}, blocking=True)  # a scalar is no array
    said = stale_warnings(caplog)
    assert len(said) == 2
    assert "step 30 may be stale: none of its 4 arrays changed since step 20" in said[0]
    assert "since step 30" in said[1]


def test_a_restarted_job_compares_with_the_step_on_its_disk(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "tiered_ckpt")
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(5, state(5), blocking=True)
    with CheckpointManager(tmp_path, world_size=1) as manager:  # its digests read from step 5's headers
        manager.restore()
        manager.save(6, state(5), blocking=True)
    (said,) = stale_warnings(caplog)
    assert "step 6 may be stale: none of its 4 arrays changed since step 5" in said


def test_the_arrays_that_must_change_are_named_and_a_frozen_part_raises_no_alarm(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "tiered_ckpt")
    runtime = RuntimeOptions(must_change=["optim"])
    with CheckpointManager(tmp_path, world_size=1, runtime=runtime) as manager:
        manager.save(1, state(1), blocking=True)
        manager.save(2, state(2, model_step=1), blocking=True)  # a frozen model: not named, no alarm
        assert stale_warnings(caplog) == []
        manager.save(3, state(3, optim_step=2), blocking=True)  # the optimizer saved from an old copy
    (said,) = stale_warnings(caplog)
    assert "none of the 2 arrays under runtime.must_change changed since step 2" in said
    assert "rank 0: optim/m" in said and "rank 0: optim/v" in said


def test_a_stale_save_is_refused_before_its_commit_when_asked(tmp_path):
    runtime = RuntimeOptions(must_change=[("optim",)], stale_saves="error")
    with CheckpointManager(tmp_path, world_size=1, runtime=runtime) as manager:
        manager.save(1, state(1), blocking=True)
        handle = manager.save(2, state(2, optim_step=1))
        with pytest.raises(SaveError, match=r"step 2 may be stale: .*optim.*nothing was committed"):
            handle.committed.result()
        assert manager.steps() == [1] and not (tmp_path / step_dir_name(2)).exists()
        manager.save(3, state(3), blocking=True)  # the next good step commits
        assert manager.steps() == [1, 3]
        restored = manager.restore()
    np.testing.assert_array_equal(restored.state["optim"]["m"], state(3)["optim"]["m"])


def test_nothing_is_said_when_asked_not_to_or_when_no_digest_was_recorded(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, "tiered_ckpt")
    with CheckpointManager(tmp_path / "off", world_size=1, runtime=RuntimeOptions(stale_saves="off")) as manager:
        manager.save(1, state(1), blocking=True)
        manager.save(2, state(1), blocking=True)
    monkeypatch.setattr(manifest_module, "_ARRAY_DIGESTS_BYTES", 0)  # as a shard of very many arrays
    with CheckpointManager(tmp_path / "many", world_size=1) as manager:
        manager.save(1, state(1), blocking=True)
        manager.save(2, state(1), blocking=True)
    assert stale_warnings(caplog) == []


def test_chunks_of_dtensors_are_compared_by_their_sha256(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "tiered_ckpt")

    def chunks(value):
        return {"w": ChunkOf(np.full((4, 3), value, np.float32), (8, 3), (0, 0))}

    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, chunks(1.0), blocking=True)
        manager.save(2, chunks(2.0), blocking=True)
        assert stale_warnings(caplog) == []
        manager.save(3, chunks(2.0), blocking=True)
    assert len(stale_warnings(caplog)) == 1


def test_every_rank_of_a_job_refuses_a_stale_step_and_none_commits_it(tmp_path):
    # Two rank processes, each its own disk: the verdict is the job's, reached from both comparisons.
    from pathlib import Path

    from support.processes import launch_ranks

    worker = Path(__file__).resolve().parents[1] / "support" / "rank_worker.py"
    actions = [
        {"do": "save", "step": 1},
        {"do": "save", "step": 2},
        {"do": "save", "step": 3, "state_of": 2},  # every rank's arrays as at step 2
        {"do": "wait"},
    ]
    config = {"actions": actions, "timeout_seconds": 60, "stale_saves": "error"}
    for rank, result in launch_ranks(worker, tmp_path, 2, config).items():
        assert result["error"][0] == "SaveError", result
        assert "step 3 may be stale: none of its" in result["error"][1] and "since step 2" in result["error"][1]
        directory = tmp_path / "nodes" / f"rank-{rank}"
        assert (directory / step_dir_name(2)).is_dir() and not (directory / step_dir_name(3)).exists()


def test_a_previous_step_that_cannot_be_read_never_fails_a_save(tmp_path, caplog):
    from support.states import flip_byte

    caplog.set_level(logging.INFO, "tiered_ckpt")
    runtime = RuntimeOptions(stale_saves="error")
    with CheckpointManager(tmp_path, world_size=1, runtime=runtime) as manager:
        manager.save(1, state(1), blocking=True)
    flip_byte(next((tmp_path / step_dir_name(1)).glob("*.safetensors")), 20)  # in its header
    with CheckpointManager(tmp_path, world_size=1, runtime=runtime) as manager:  # nothing kept: headers are read
        manager.save(2, state(1), blocking=True)  # the same arrays: but not judged, and committed
        with pytest.raises(SaveError, match="step 3 may be stale"):
            manager.save(3, state(1), blocking=True)  # against step 2, kept: judged
        assert manager.steps() == [1, 2]
    assert any("step 2 is not compared with step 1" in r.getMessage() for r in caplog.records)


def test_must_change_paths_follow_the_structure_and_one_naming_nothing_is_said_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "tiered_ckpt")

    def nested(step, optim_step):
        return {
            "model": {"w": np.full(4, float(step))},
            "optims": [{"m": np.full(3, float(optim_step))}, {"m": np.ones(2)}],  # a list, as torch gives
            "a/b": {"c": np.full(2, float(optim_step))},  # a key holding "/"
        }

    runtime = RuntimeOptions(must_change=[("optims", 0), ("a/b",), "nothing_here"])
    with CheckpointManager(tmp_path, world_size=1, runtime=runtime) as manager:
        manager.save(1, nested(1, 1), blocking=True)
        manager.save(2, nested(2, 1), blocking=True)
        manager.save(3, nested(3, 3), blocking=True)
    said = stale_warnings(caplog)
    assert len(said) == 1 and "none of the 2 arrays under runtime.must_change changed since step 1" in said[0]
    assert "rank 0: optims/0/m" in said[0] and "rank 0: a%2Fb/c" in said[0]
    nothing = [r.getMessage() for r in caplog.records if "nothing_here" in r.getMessage()]
    assert len(nothing) == 1 and "no stale-save check for it" in nothing[0]


def test_a_stale_step_of_a_preemption_is_said_not_refused(caplog):
    from tiered_ckpt.engine.stale import Comparison, StaleCheck

    caplog.set_level(logging.WARNING, "tiered_ckpt")
    stale = Comparison(previous=4, arrays=3, compared=3, changed=0).to_dict()
    StaleCheck("error").check(5, [stale, stale], leader=True, refuse=False)  # the job's last step: kept
    assert stale_warnings(caplog) == [
        "step 5 may be stale: none of its 6 arrays changed since step 4 (runtime.stale_saves='error')"
    ]
    with pytest.raises(Exception, match="nothing was committed"):
        StaleCheck("error").check(5, [stale, stale], leader=True)
