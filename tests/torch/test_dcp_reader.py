"""TieredReader: the step it loads and where from (its own disk first, the bucket only for
what it lacks), DCP's template-free loads, older layouts, and shards its writer would not write."""

from __future__ import annotations

import inspect
import shutil

import numpy as np
import pytest

from support.dcp_support import failure, run_job
from support.dcp_worker import digests, train_state
from support.stores import FaultInjectingProxy, s3_storage_options
from tiered_ckpt import ShardFormatError
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.format.state import ChunkOf

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint import format_utils  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys  # noqa: E402

from tiered_ckpt.torch import TieredReader, TieredWriter  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")


def test_a_loaded_step_that_is_not_committed_names_the_committed_ones(manager):
    dcp.save({"w": torch.ones(2)}, storage_writer=TieredWriter(manager, 10))
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(2)}, storage_reader=TieredReader(manager), checkpoint_id=11)
    assert "step 11 is not committed; committed steps: [10]" in str(failure(caught))  # DCP restates it


def test_template_free_loads_give_the_nested_state(manager, tmp_path, monkeypatch):
    state = train_state(10, 0)
    dcp.save(state, storage_writer=TieredWriter(manager, 10))
    expected = digests(state)

    whole = _load_state_dict_from_keys(storage_reader=TieredReader(manager, 10))
    assert sorted(whole) == ["extra", "model", "optim"] and digests(whole) == expected
    assert sorted(whole["optim"]["state"]) == ["0", "1", "2", "3"]  # as DCP's flattening records them
    assert isinstance(whole["optim"]["param_groups"], list)  # a list stays a list (its indices are ints)
    part = _load_state_dict_from_keys({"model", "extra.step"}, storage_reader=TieredReader(manager, 10))
    assert list(part) == ["model", "extra"] and part["extra"] == {"step": 10}
    assert digests(part["model"]) == digests(state["model"])

    # dcp_to_torch_save reads through the reader it is handed (DCP's own names a directory)
    monkeypatch.setattr(format_utils, "FileSystemReader", lambda _directory: TieredReader(manager, 10))
    format_utils.dcp_to_torch_save("step 10", tmp_path / "step10.pt")
    assert digests(torch.load(tmp_path / "step10.pt", weights_only=False)) == expected  # our own file


def test_read_metadata_takes_no_rank_argument_so_dcp_never_retries_it_on_one_rank_alone():
    # DCP calls read_metadata(rank=...) on a rank whose read_metadata() failed, if it accepts
    # keyword arguments, and then skips the collectives the other ranks run.
    assert list(inspect.signature(TieredReader.read_metadata).parameters) == ["self"]


@pytest.mark.slow
def test_a_load_right_after_a_save_reads_nothing_another_rank_has_not_uploaded(tmp_path, moto_endpoint, s3_url):
    # no shard upload lands (what else the manager writes to the bucket goes through)
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=0.0, stall=("PUT", "POST"), stall_paths=(".safetensors",))
    try:
        remote = (s3_url[0], s3_storage_options(proxy.endpoint))
        actions = [
            {"do": "save", "step": 10},
            {"do": "load", "id": None, "as": "newest"},
            {"do": "load", "id": 10, "as": "10"},
        ]
        results = run_job(tmp_path, actions, remote=remote)
    finally:
        proxy.close()
    for result in results.values():
        assert "error" not in result, result
        assert result["loaded"]["newest"] == result["saved"]["10"] == result["loaded"]["10"]
        assert result["remote_steps"] == []  # the loads ran with no shard in the bucket


@pytest.mark.slow
def test_ranks_that_find_different_newest_steps_refuse_the_load_on_every_rank(tmp_path):
    run_job(tmp_path, [{"do": "save", "step": 10}, {"do": "save", "step": 20}])
    shutil.rmtree(tmp_path / "nodes" / "rank-1" / step_dir_name(20))  # rank 1's disk lost step 20
    results = run_job(tmp_path, [{"do": "load", "id": None, "as": "newest"}])
    for result in results.values():
        assert "different steps" in result["error"][1] and "checkpoint_id" in result["error"][1], result
    results = run_job(tmp_path, [{"do": "load", "id": 10, "as": "10"}])
    assert all("error" not in result for result in results.values()), results


@pytest.mark.slow
def test_a_step_the_writer_of_0_2_saved_loads_its_values_from_rank_0s_shard(tmp_path, file_url):
    actions = [{"do": "save_as_0_2", "step": 5}, {"do": "load_0_2", "id": 5, "as": "5"}]
    for result in run_job(tmp_path, actions, remote=file_url).values():
        assert "error" not in result, result
        assert result["loaded"]["5"] == {"w": [float(i) for i in range(8)], "epoch": 5}


def test_a_chunk_another_writer_saved_is_refused_by_the_reader_naming_it(manager):
    manager.save(1, {"other": ChunkOf(np.ones(2), (4,), (0,))})
    with pytest.raises(ShardFormatError, match="rank 0 of step 1: 'other' is not a chunk written by TieredWriter"):
        TieredReader(manager, 1).read_metadata()


@pytest.mark.parametrize(
    "section, problem",
    [({"tensors": {"w": {"0": ChunkOf(np.ones(3, np.float32), (3,), (0,))}}, "complex": {"w": "complex64"}},
      "'dcp/tensors/w/0' is not the float pairs of a complex tensor"),
     ({"tensors": {}, "complex": {"w": "complex256"}}, "dcp/complex names a dtype other than"),
     ({"tensors": {}, "planner_data": {"w": "w"}}, "dcp/planner_data must map each key to a list")],
)  # fmt: skip
def test_a_shard_that_is_not_what_the_writer_writes_is_refused_naming_the_rank_and_step(manager, section, problem):
    manager.save(3, {"dcp": section})
    with pytest.raises(ShardFormatError, match=f"rank 0 of step 3: {problem}"):
        TieredReader(manager, 3).read_metadata()


def test_a_stored_value_of_an_unknown_kind_is_refused_naming_it_and_nothing_is_unpickled(manager):
    blob = {"pickle": ChunkOf(np.frombuffer(b"\x80\x04N.", np.uint8), (4,), (0,))}
    manager.save(4, {"dcp": {"tensors": {}, "blobs": {"x": blob}, "planner_data": {}}})
    into = {"x": b""}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(into, storage_reader=TieredReader(manager, 4))
    error = failure(caught)
    assert isinstance(error, ShardFormatError) and "rank 0 of step 4: 'x' has unknown kind 'pickle'" in str(error)
    assert into == {"x": b""}
