"""TieredWriter: a save with no step, a value the reader could not give back, and DCP's
process-based async_save are refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest

from support.dcp_support import WORKER, failure
from support.processes import launch_ranks
from tiered_ckpt import CheckpointManager, InvalidStateError, UsageError

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from tiered_ckpt.torch import TieredWriter  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")


def test_a_writer_with_no_step_refuses_the_save(manager):
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.ones(2)}, storage_writer=TieredWriter(manager))
    assert isinstance(failure(caught), UsageError) and "no step" in str(failure(caught))
    assert manager.steps() == []


@pytest.mark.parametrize(
    "value, path, problem",
    [
        ({1, 2}, 'state["train"]["odd"]', "builtins.set"),
        (np.array([object()], dtype=object), 'state["train"]["odd"]', "dtype object"),
        ([1, {"x": frozenset()}], 'state["train"]["odd"][1]["x"]', "frozenset"),
    ],
)
def test_a_value_the_reader_could_not_give_back_is_refused_before_anything_is_written(manager, value, path, problem):
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.ones(2), "train": {"odd": value}}, storage_writer=TieredWriter(manager, 1))
    error = failure(caught)
    assert isinstance(error, InvalidStateError) and path in str(error) and problem in str(error), error
    assert manager.steps() == [] and not list(manager.root.glob("step-*"))


@pytest.mark.slow
def test_async_save_in_a_process_is_refused_saying_why(tmp_path):
    result = launch_ranks(WORKER, tmp_path, 1, {"actions": [{"do": "async_save_process", "step": 10}]})[0]
    assert result["error"][0] == "UsageError", result
    assert "AsyncCheckpointerType.PROCESS" in result["error"][1]  # what was refused
    assert "AsyncCheckpointerType.THREAD" in result["error"][1]  # and what works
    assert not list((tmp_path / "nodes" / "rank-0").glob("step-*"))


def test_a_manager_holding_several_ranks_is_refused_as_dcp_runs_one_rank_per_process(tmp_path):
    with CheckpointManager(tmp_path / "ckpt", world_size=2) as manager:
        with pytest.raises(UsageError, match=r"one rank per process.*holds ranks \[0, 1\]"):
            TieredWriter(manager, 1)
        assert manager.steps() == []
